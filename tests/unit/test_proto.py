"""Wire compatibility of extauthz.proto with Envoy's ext_authz and access-log gRPC APIs.

The fixtures in tests/fixtures/wire/*.bin were serialized with the real Envoy classes of
``xds-protos`` 1.85.0 (protobuf 7.36.2) in a throwaway venv; decoding them here proves
compatibility without xds-protos installed:

- check_request.bin: CheckRequest as the HTTP ext_authz filter sends it.
- check_response_denied.bin / check_response_ok.bin: CheckResponse variants.
- access_logs.bin: StreamAccessLogsMessage (envoy.access_loggers.http_grpc) including
  fields our subset does not declare (Node.locality/user_agent_name,
  AccessLogCommon.tls_properties), which must be skipped on decode and kept on re-encode.
"""

from __future__ import annotations

import pathlib
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import struct_pb2

from extauthz.proto import (
    accesslog_data_pb2,
    accesslog_pb2,
    accesslog_pb2_grpc,
    auth_pb2,
    auth_pb2_grpc,
    core_pb2,
    http_status_pb2,
    ratelimit_common_pb2,
    ratelimit_unit_pb2,
    rls_pb2,
    status_pb2,
)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "wire"
EXT_AUTHZ_NS = "envoy.filters.http.ext_authz"
FD = _descriptor.FieldDescriptor


def _fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


# --- (a) CheckRequest round trip -------------------------------------------------------


def test_check_request_round_trip() -> None:
    req = auth_pb2.CheckRequest()
    attrs = req.attributes
    attrs.source.address.socket_address.address = "10.1.2.3"
    attrs.source.address.socket_address.port_value = 54321
    http = attrs.request.http
    http.method = "GET"
    http.path = "/v1/items?page=2"
    http.headers.update(
        {"x-request-id": "rid-1", "x-user-id": "u-7", ":authority": "api"}
    )
    attrs.context_extensions["route_class"] = "items-read"
    attrs.route_metadata_context.filter_metadata["extauthz"].update(
        {"tier": "critical"}
    )

    data = req.SerializeToString()
    got = auth_pb2.CheckRequest.FromString(data)

    assert got == req
    g = got.attributes
    assert g.source.address.WhichOneof("address") == "socket_address"
    assert g.source.address.socket_address.address == "10.1.2.3"
    assert g.source.address.socket_address.port_value == 54321
    assert g.request.http.method == "GET"
    assert g.request.http.path == "/v1/items?page=2"
    assert dict(g.request.http.headers) == {
        "x-request-id": "rid-1",
        "x-user-id": "u-7",
        ":authority": "api",
    }
    assert dict(g.context_extensions) == {"route_class": "items-read"}
    assert g.route_metadata_context.filter_metadata["extauthz"]["tier"] == "critical"


# --- (b) CheckResponse round trip ------------------------------------------------------


def test_check_response_denied_round_trip() -> None:
    resp = auth_pb2.CheckResponse()
    resp.status.code = 8  # google.rpc.Code.RESOURCE_EXHAUSTED
    resp.denied_response.status.code = http_status_pb2.TooManyRequests
    resp.denied_response.headers.add(
        header=core_pb2.HeaderValue(key="retry-after", value="2"),
        append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    resp.denied_response.body = "too many requests"
    resp.dynamic_metadata.update({"decision": "deny", "tier": "critical"})

    got = auth_pb2.CheckResponse.FromString(resp.SerializeToString())

    assert got == resp
    assert isinstance(got.status, status_pb2.Status)
    assert got.status.code == 8
    assert got.WhichOneof("http_response") == "denied_response"
    assert got.denied_response.status.code == 429
    (hdr,) = got.denied_response.headers
    assert (hdr.header.key, hdr.header.value) == ("retry-after", "2")
    assert hdr.append_action == core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert got.denied_response.body == "too many requests"
    assert dict(got.dynamic_metadata) == {"decision": "deny", "tier": "critical"}


def test_status_codes_used_by_server() -> None:
    assert http_status_pb2.Empty == 0
    assert http_status_pb2.OK == 200
    assert http_status_pb2.Forbidden == 403
    assert http_status_pb2.TooManyRequests == 429
    assert http_status_pb2.ServiceUnavailable == 503
    assert http_status_pb2.StatusCode.Name(429) == "TooManyRequests"


# --- (c) xds-protos collision guard ----------------------------------------------------


def test_opentelemetry_proto_not_clobbered() -> None:
    # xds-protos ships an old copy of opentelemetry/proto/** that lacks InstrumentationScope
    # and breaks the OTLP exporter; these imports fail if it ever gets installed again.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert InstrumentationScope.DESCRIPTOR.full_name == (
        "opentelemetry.proto.common.v1.InstrumentationScope"
    )
    assert OTLPSpanExporter is not None


def test_names_and_layout() -> None:
    # Envoy's package/message names (the wire identity) ...
    assert (
        auth_pb2.CheckRequest.DESCRIPTOR.full_name
        == "envoy.service.auth.v3.CheckRequest"
    )
    assert (
        accesslog_pb2.StreamAccessLogsMessage.DESCRIPTOR.full_name
        == "envoy.service.accesslog.v3.StreamAccessLogsMessage"
    )
    # ... in descriptor files that cannot collide with xds-protos' envoy/**.proto ...
    for mod in (auth_pb2, accesslog_pb2, accesslog_data_pb2, core_pb2, http_status_pb2, rls_pb2,
                ratelimit_common_pb2, ratelimit_unit_pb2):
        assert mod.DESCRIPTOR.name.startswith("extauthz_wire/"), mod.DESCRIPTOR.name
        assert mod.__name__.startswith("extauthz.proto.extauthz_wire.")
    assert auth_pb2.CheckRequest.__module__ == "extauthz.proto.extauthz_wire.auth_pb2"
    # ... and google.rpc.Status is googleapis-common-protos' canonical one.
    assert status_pb2.DESCRIPTOR.name == "google/rpc/status.proto"
    assert auth_pb2.CheckResponse.DESCRIPTOR.fields_by_name["status"].message_type is (
        status_pb2.Status.DESCRIPTOR
    )
    # gRPC method paths Envoy calls.
    svc = auth_pb2.DESCRIPTOR.services_by_name["Authorization"]
    assert svc.full_name == "envoy.service.auth.v3.Authorization"
    assert [m.name for m in svc.methods] == ["Check"]
    als = accesslog_pb2.DESCRIPTOR.services_by_name["AccessLogService"]
    assert als.full_name == "envoy.service.accesslog.v3.AccessLogService"
    assert als.methods_by_name["StreamAccessLogs"].client_streaming
    rls = rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"]
    assert rls.full_name == "envoy.service.ratelimit.v3.RateLimitService"
    assert [m.name for m in rls.methods] == ["ShouldRateLimit"]
    # Envoy's unit numbers (WEEK came last)
    assert [(u.name, u.number) for u in ratelimit_unit_pb2.RateLimitUnit.DESCRIPTOR.values] == [
        ("UNKNOWN", 0), ("SECOND", 1), ("MINUTE", 2), ("HOUR", 3), ("DAY", 4), ("MONTH", 5), ("YEAR", 6),
        ("WEEK", 7)]
    assert hasattr(auth_pb2_grpc, "add_AuthorizationServicer_to_server")
    assert hasattr(accesslog_pb2_grpc, "add_AccessLogServiceServicer_to_server")


# --- (d) field numbers verified against Envoy's sources --------------------------------

_M = FD.TYPE_MESSAGE
_S = FD.TYPE_STRING

# (message descriptor, field name, number, wire type, message/enum full name or None)
FIELD_NUMBERS = [
    # api/envoy/service/auth/v3/external_auth.proto
    (
        auth_pb2.CheckRequest,
        "attributes",
        1,
        _M,
        "envoy.service.auth.v3.AttributeContext",
    ),
    (auth_pb2.CheckResponse, "status", 1, _M, "google.rpc.Status"),
    (
        auth_pb2.CheckResponse,
        "denied_response",
        2,
        _M,
        "envoy.service.auth.v3.DeniedHttpResponse",
    ),
    (
        auth_pb2.CheckResponse,
        "ok_response",
        3,
        _M,
        "envoy.service.auth.v3.OkHttpResponse",
    ),
    (auth_pb2.CheckResponse, "dynamic_metadata", 4, _M, "google.protobuf.Struct"),
    (
        auth_pb2.CheckResponse,
        "error_response",
        5,
        _M,
        "envoy.service.auth.v3.DeniedHttpResponse",
    ),
    (auth_pb2.DeniedHttpResponse, "status", 1, _M, "envoy.type.v3.HttpStatus"),
    (
        auth_pb2.DeniedHttpResponse,
        "headers",
        2,
        _M,
        "envoy.config.core.v3.HeaderValueOption",
    ),
    (auth_pb2.DeniedHttpResponse, "body", 3, _S, None),
    (
        auth_pb2.OkHttpResponse,
        "headers",
        2,
        _M,
        "envoy.config.core.v3.HeaderValueOption",
    ),
    (auth_pb2.OkHttpResponse, "headers_to_remove", 5, _S, None),
    (
        auth_pb2.OkHttpResponse,
        "response_headers_to_add",
        6,
        _M,
        "envoy.config.core.v3.HeaderValueOption",
    ),
    (
        auth_pb2.OkHttpResponse,
        "query_parameters_to_set",
        7,
        _M,
        "envoy.config.core.v3.QueryParameter",
    ),
    (auth_pb2.OkHttpResponse, "query_parameters_to_remove", 8, _S, None),
    # api/envoy/service/auth/v3/attribute_context.proto
    (
        auth_pb2.AttributeContext,
        "source",
        1,
        _M,
        "envoy.service.auth.v3.AttributeContext.Peer",
    ),
    (
        auth_pb2.AttributeContext,
        "destination",
        2,
        _M,
        "envoy.service.auth.v3.AttributeContext.Peer",
    ),
    (
        auth_pb2.AttributeContext,
        "request",
        4,
        _M,
        "envoy.service.auth.v3.AttributeContext.Request",
    ),
    (
        auth_pb2.AttributeContext,
        "context_extensions",
        10,
        _M,
        None,
    ),  # map<string, string>
    (
        auth_pb2.AttributeContext,
        "metadata_context",
        11,
        _M,
        "envoy.config.core.v3.Metadata",
    ),
    (
        auth_pb2.AttributeContext,
        "tls_session",
        12,
        _M,
        "envoy.service.auth.v3.AttributeContext.TLSSession",
    ),
    (
        auth_pb2.AttributeContext,
        "route_metadata_context",
        13,
        _M,
        "envoy.config.core.v3.Metadata",
    ),
    (auth_pb2.AttributeContext.Peer, "address", 1, _M, "envoy.config.core.v3.Address"),
    (auth_pb2.AttributeContext.Peer, "service", 2, _S, None),
    (auth_pb2.AttributeContext.Peer, "labels", 3, _M, None),
    (auth_pb2.AttributeContext.Peer, "principal", 4, _S, None),
    (auth_pb2.AttributeContext.Request, "time", 1, _M, "google.protobuf.Timestamp"),
    (
        auth_pb2.AttributeContext.Request,
        "http",
        2,
        _M,
        "envoy.service.auth.v3.AttributeContext.HttpRequest",
    ),
    (auth_pb2.AttributeContext.HttpRequest, "id", 1, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "method", 2, _S, None),
    (
        auth_pb2.AttributeContext.HttpRequest,
        "headers",
        3,
        _M,
        None,
    ),  # map<string, string>
    (auth_pb2.AttributeContext.HttpRequest, "path", 4, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "host", 5, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "scheme", 6, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "size", 9, FD.TYPE_INT64, None),
    (auth_pb2.AttributeContext.HttpRequest, "protocol", 10, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "body", 11, _S, None),
    (auth_pb2.AttributeContext.HttpRequest, "raw_body", 12, FD.TYPE_BYTES, None),
    (
        auth_pb2.AttributeContext.HttpRequest,
        "header_map",
        13,
        _M,
        "envoy.config.core.v3.HeaderMap",
    ),
    # api/envoy/config/core/v3/base.proto (+ header_value.proto in newer Envoy)
    (core_pb2.Metadata, "filter_metadata", 1, _M, None),  # map<string, Struct>
    (core_pb2.Metadata, "typed_filter_metadata", 2, _M, None),  # map<string, Any>
    (core_pb2.HeaderValue, "key", 1, _S, None),
    (core_pb2.HeaderValue, "value", 2, _S, None),
    (core_pb2.HeaderValue, "raw_value", 3, FD.TYPE_BYTES, None),
    (core_pb2.HeaderValueOption, "header", 1, _M, "envoy.config.core.v3.HeaderValue"),
    (core_pb2.HeaderValueOption, "append", 2, _M, "google.protobuf.BoolValue"),
    (
        core_pb2.HeaderValueOption,
        "append_action",
        3,
        FD.TYPE_ENUM,
        "envoy.config.core.v3.HeaderValueOption.HeaderAppendAction",
    ),
    (core_pb2.HeaderValueOption, "keep_empty_value", 4, FD.TYPE_BOOL, None),
    (core_pb2.HeaderMap, "headers", 1, _M, "envoy.config.core.v3.HeaderValue"),
    (core_pb2.Node, "id", 1, _S, None),
    (core_pb2.Node, "cluster", 2, _S, None),
    # api/envoy/config/core/v3/address.proto
    (core_pb2.Address, "socket_address", 1, _M, "envoy.config.core.v3.SocketAddress"),
    (core_pb2.Address, "pipe", 2, _M, "envoy.config.core.v3.Pipe"),
    (core_pb2.SocketAddress, "address", 2, _S, None),
    (core_pb2.SocketAddress, "port_value", 3, FD.TYPE_UINT32, None),
    # api/envoy/type/v3/http_status.proto
    (http_status_pb2.HttpStatus, "code", 1, FD.TYPE_ENUM, "envoy.type.v3.StatusCode"),
    # googleapis google/rpc/status.proto
    (status_pb2.Status, "code", 1, FD.TYPE_INT32, None),
    (status_pb2.Status, "message", 2, _S, None),
    (status_pb2.Status, "details", 3, _M, "google.protobuf.Any"),
    # api/envoy/service/accesslog/v3/als.proto
    (
        accesslog_pb2.StreamAccessLogsMessage,
        "identifier",
        1,
        _M,
        "envoy.service.accesslog.v3.StreamAccessLogsMessage.Identifier",
    ),
    (
        accesslog_pb2.StreamAccessLogsMessage,
        "http_logs",
        2,
        _M,
        "envoy.service.accesslog.v3.StreamAccessLogsMessage.HTTPAccessLogEntries",
    ),
    (
        accesslog_pb2.StreamAccessLogsMessage,
        "tcp_logs",
        3,
        _M,
        "envoy.service.accesslog.v3.StreamAccessLogsMessage.TCPAccessLogEntries",
    ),
    (
        accesslog_pb2.StreamAccessLogsMessage.Identifier,
        "node",
        1,
        _M,
        "envoy.config.core.v3.Node",
    ),
    (accesslog_pb2.StreamAccessLogsMessage.Identifier, "log_name", 2, _S, None),
    (
        accesslog_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries,
        "log_entry",
        1,
        _M,
        "envoy.data.accesslog.v3.HTTPAccessLogEntry",
    ),
    # api/envoy/data/accesslog/v3/accesslog.proto
    (
        accesslog_data_pb2.HTTPAccessLogEntry,
        "common_properties",
        1,
        _M,
        "envoy.data.accesslog.v3.AccessLogCommon",
    ),
    (
        accesslog_data_pb2.HTTPAccessLogEntry,
        "protocol_version",
        2,
        FD.TYPE_ENUM,
        "envoy.data.accesslog.v3.HTTPAccessLogEntry.HTTPVersion",
    ),
    (
        accesslog_data_pb2.HTTPAccessLogEntry,
        "request",
        3,
        _M,
        "envoy.data.accesslog.v3.HTTPRequestProperties",
    ),
    (
        accesslog_data_pb2.HTTPAccessLogEntry,
        "response",
        4,
        _M,
        "envoy.data.accesslog.v3.HTTPResponseProperties",
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "downstream_remote_address",
        2,
        _M,
        "envoy.config.core.v3.Address",
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "start_time",
        5,
        _M,
        "google.protobuf.Timestamp",
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "time_to_last_downstream_tx_byte",
        12,
        _M,
        "google.protobuf.Duration",
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "response_flags",
        16,
        _M,
        "envoy.data.accesslog.v3.ResponseFlags",
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "metadata",
        17,
        _M,
        "envoy.config.core.v3.Metadata",
    ),
    (accesslog_data_pb2.AccessLogCommon, "route_name", 19, _S, None),
    (
        accesslog_data_pb2.AccessLogCommon,
        "duration",
        23,
        _M,
        "google.protobuf.Duration",
    ),
    (accesslog_data_pb2.AccessLogCommon, "stream_id", 26, _S, None),
    (
        accesslog_data_pb2.AccessLogCommon,
        "intermediate_log_entry",
        27,
        FD.TYPE_BOOL,
        None,
    ),
    (
        accesslog_data_pb2.AccessLogCommon,
        "access_log_type",
        33,
        FD.TYPE_ENUM,
        "envoy.data.accesslog.v3.AccessLogType",
    ),
    (
        accesslog_data_pb2.ResponseFlags,
        "downstream_connection_termination",
        15,
        FD.TYPE_BOOL,
        None,
    ),
    (
        accesslog_data_pb2.HTTPRequestProperties,
        "request_method",
        1,
        FD.TYPE_ENUM,
        "envoy.config.core.v3.RequestMethod",
    ),
    (accesslog_data_pb2.HTTPRequestProperties, "path", 5, _S, None),
    (accesslog_data_pb2.HTTPRequestProperties, "request_id", 9, _S, None),
    (
        accesslog_data_pb2.HTTPResponseProperties,
        "response_code",
        1,
        _M,
        "google.protobuf.UInt32Value",
    ),
    (accesslog_data_pb2.HTTPResponseProperties, "response_code_details", 6, _S, None),
    # envoy/service/ratelimit/v3/rls.proto, envoy/extensions/common/ratelimit/v3/ratelimit.proto
    (rls_pb2.RateLimitRequest, "domain", 1, _S, None),
    (rls_pb2.RateLimitRequest, "descriptors", 2, _M, "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor"),
    (rls_pb2.RateLimitRequest, "hits_addend", 3, FD.TYPE_UINT32, None),
    (ratelimit_common_pb2.RateLimitDescriptor, "entries", 1, _M,
     "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.Entry"),
    (ratelimit_common_pb2.RateLimitDescriptor, "limit", 2, _M,
     "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.RateLimitOverride"),
    (ratelimit_common_pb2.RateLimitDescriptor, "hits_addend", 3, _M, "google.protobuf.UInt64Value"),
    (ratelimit_common_pb2.RateLimitDescriptor.Entry, "key", 1, _S, None),
    (ratelimit_common_pb2.RateLimitDescriptor.Entry, "value", 2, _S, None),
    (ratelimit_common_pb2.RateLimitDescriptor.RateLimitOverride, "requests_per_unit", 1, FD.TYPE_UINT32, None),
    (ratelimit_common_pb2.RateLimitDescriptor.RateLimitOverride, "unit", 2, FD.TYPE_ENUM,
     "envoy.type.v3.RateLimitUnit"),
    (rls_pb2.RateLimitResponse, "overall_code", 1, FD.TYPE_ENUM, "envoy.service.ratelimit.v3.RateLimitResponse.Code"),
    (rls_pb2.RateLimitResponse, "statuses", 2, _M, "envoy.service.ratelimit.v3.RateLimitResponse.DescriptorStatus"),
    (rls_pb2.RateLimitResponse, "response_headers_to_add", 3, _M, "envoy.config.core.v3.HeaderValue"),
    (rls_pb2.RateLimitResponse, "request_headers_to_add", 4, _M, "envoy.config.core.v3.HeaderValue"),
    (rls_pb2.RateLimitResponse, "raw_body", 5, FD.TYPE_BYTES, None),
    (rls_pb2.RateLimitResponse, "dynamic_metadata", 6, _M, "google.protobuf.Struct"),
    (rls_pb2.RateLimitResponse.DescriptorStatus, "code", 1, FD.TYPE_ENUM,
     "envoy.service.ratelimit.v3.RateLimitResponse.Code"),
    (rls_pb2.RateLimitResponse.DescriptorStatus, "current_limit", 2, _M,
     "envoy.service.ratelimit.v3.RateLimitResponse.RateLimit"),
    (rls_pb2.RateLimitResponse.DescriptorStatus, "limit_remaining", 3, FD.TYPE_UINT32, None),
    (rls_pb2.RateLimitResponse.DescriptorStatus, "duration_until_reset", 4, _M, "google.protobuf.Duration"),
    (rls_pb2.RateLimitResponse.RateLimit, "requests_per_unit", 1, FD.TYPE_UINT32, None),
    (rls_pb2.RateLimitResponse.RateLimit, "unit", 2, FD.TYPE_ENUM,
     "envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit"),
    (rls_pb2.RateLimitResponse.RateLimit, "name", 3, _S, None),
]


@pytest.mark.parametrize(
    ("msg", "name", "number", "ftype", "type_name"),
    FIELD_NUMBERS,
    ids=[f"{m.DESCRIPTOR.name}.{n}" for m, n, *_ in FIELD_NUMBERS],
)
def test_field_numbers_match_envoy(msg, name, number, ftype, type_name) -> None:
    field = msg.DESCRIPTOR.fields_by_name[name]
    assert field.number == number
    assert field.type == ftype
    if type_name is not None:
        ref = field.message_type or field.enum_type
        assert ref.full_name == type_name


def test_oneofs_match_envoy() -> None:
    resp = auth_pb2.CheckResponse.DESCRIPTOR.oneofs_by_name["http_response"]
    assert {f.name for f in resp.fields} == {
        "denied_response",
        "ok_response",
        "error_response",
    }
    logs = accesslog_pb2.StreamAccessLogsMessage.DESCRIPTOR.oneofs_by_name[
        "log_entries"
    ]
    assert {f.name for f in logs.fields} == {"http_logs", "tcp_logs"}
    addr = core_pb2.Address.DESCRIPTOR.oneofs_by_name["address"]
    assert {f.name for f in addr.fields} == {
        "socket_address",
        "pipe",
        "envoy_internal_address",
    }


# --- (7) bytes serialized by xds-protos decode with our classes ------------------------


def test_fixture_check_request_from_xds_protos() -> None:
    data = _fixture("check_request.bin")
    a = auth_pb2.CheckRequest.FromString(data).attributes
    assert a.source.address.socket_address.address == "10.1.2.3"
    assert a.source.address.socket_address.port_value == 54321
    assert a.source.principal == "spiffe://cluster.local/ns/default/sa/client"
    assert dict(a.source.labels) == {"app": "client"}
    assert a.destination.service == "api"
    assert a.destination.address.socket_address.port_value == 8080
    assert a.request.time.seconds == 1_790_000_000
    h = a.request.http
    assert (h.id, h.method, h.path, h.host, h.scheme) == (
        "8861371938463478012",
        "POST",
        "/v1/orders?x=1",
        "api.example.com",
        "https",
    )
    assert (h.size, h.protocol, h.body) == (17, "HTTP/2", '{"qty": 1}')
    assert h.headers["x-request-id"] == "5f0c6c7e-2a6e-4f5e-9a47-1b2f8c9d0e11"
    assert h.headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert len(h.headers) == 8
    assert dict(a.context_extensions) == {
        "route_class": "orders-write",
        "tier": "critical",
    }
    assert a.route_metadata_context.filter_metadata["extauthz"]["tier"] == "critical"
    assert (
        a.metadata_context.filter_metadata["envoy.filters.http.jwt_authn"]["sub"]
        == "user-42"
    )
    assert a.tls_session.sni == "api.example.com"


def test_fixture_check_responses_from_xds_protos() -> None:
    deny = auth_pb2.CheckResponse.FromString(_fixture("check_response_denied.bin"))
    assert (deny.status.code, deny.status.message) == (8, "rate limited")
    assert deny.WhichOneof("http_response") == "denied_response"
    d = deny.denied_response
    assert d.status.code == http_status_pb2.TooManyRequests
    assert [(h.header.key, h.header.value) for h in d.headers] == [
        ("retry-after", "2"),
        ("content-type", "application/json"),
    ]
    assert d.headers[0].HasField("append") and d.headers[0].append.value is False
    assert (
        d.headers[0].append_action
        == core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    )
    assert d.body == '{"error": "too many requests"}'
    assert dict(deny.dynamic_metadata) == {
        "decision": "deny",
        "tier": "critical",
        "lease_id": "",
        "cost": 1.0,
    }

    ok = auth_pb2.CheckResponse.FromString(_fixture("check_response_ok.bin"))
    assert ok.status.code == 0
    assert ok.WhichOneof("http_response") == "ok_response"
    assert ok.ok_response.headers[0].header.key == "x-extauthz-tier"
    assert list(ok.ok_response.headers_to_remove) == ["x-internal-debug"]
    assert ok.ok_response.response_headers_to_add[0].header.value == "9"
    assert ok.dynamic_metadata["lease_id"] == "lease-123"


def test_fixture_access_logs_from_xds_protos() -> None:
    data = _fixture("access_logs.bin")
    msg = accesslog_pb2.StreamAccessLogsMessage.FromString(data)
    assert msg.identifier.node.id == "envoy-node-1"
    assert msg.identifier.node.cluster == "edge"
    assert msg.identifier.log_name == "extauthz_leases"
    assert msg.WhichOneof("log_entries") == "http_logs"
    first, second = msg.http_logs.log_entry

    for entry, lease in ((first, "lease-123"), (second, "")):
        c = entry.common_properties
        ext = c.metadata.filter_metadata[EXT_AUTHZ_NS]
        assert isinstance(ext, struct_pb2.Struct)
        assert dict(ext) == {"lease_id": lease, "tier": "critical"}
        assert c.access_log_type == accesslog_data_pb2.DownstreamEnd
        assert c.downstream_remote_address.socket_address.address == "10.1.2.3"
        assert c.time_to_last_downstream_tx_byte.ToMilliseconds() == 1
        assert entry.protocol_version == accesslog_data_pb2.HTTPAccessLogEntry.HTTP2
        assert entry.request.request_method == core_pb2.POST
        assert entry.request.path == "/v1/orders"

    assert first.request.request_id == "req-0"
    assert first.response.response_code.value == 200
    assert first.common_properties.start_time.seconds == 1_790_000_000
    assert not first.common_properties.HasField("response_flags")
    assert second.response.response_code.value == 429
    assert second.response.response_code_details == "ext_authz_denied"
    flags = second.common_properties.response_flags
    assert flags.downstream_connection_termination
    assert flags.unauthorized_details.reason == (
        accesslog_data_pb2.ResponseFlags.Unauthorized.EXTERNAL_SERVICE
    )
    # Fields we do not declare (Node.locality, tls_properties, ...) are kept as unknown
    # fields: re-encoding loses nothing.
    assert len(msg.SerializeToString()) == len(data)


# --- generated gRPC glue serves Envoy's method path ------------------------------------


class _Authz(auth_pb2_grpc.AuthorizationServicer):
    def Check(self, request, context):
        resp = auth_pb2.CheckResponse()
        resp.ok_response.headers.add(
            header=core_pb2.HeaderValue(
                key="x-seen-path", value=request.attributes.request.http.path
            )
        )
        return resp


def test_grpc_check_method_path() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    auth_pb2_grpc.add_AuthorizationServicer_to_server(_Authz(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            # Raw bytes on the exact path Envoy uses, no client stub involved.
            call = channel.unary_unary("/envoy.service.auth.v3.Authorization/Check")
            raw = call(_fixture("check_request.bin"), timeout=5)
        resp = auth_pb2.CheckResponse.FromString(raw)
        assert resp.ok_response.headers[0].header.value == "/v1/orders?x=1"
    finally:
        server.stop(None)
