"""Conversion at the edge: CheckRequest -> RawRequest, Decision -> CheckResponse.

The only module that reads Envoy's attribute chains or builds Envoy's messages.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import struct_pb2

from ..answers import denial, ratelimit_headers
from ..context import RawRequest, RequestContext
from ..proto import auth_pb2, core_pb2, http_status_pb2, status_pb2
from ..verdict import Decision

#: where Envoy files the CheckResponse's dynamic metadata (and the access log shows it).
EXT_AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
TIER_HEADER = "x-extauthz-tier"

_OVERWRITE = core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_GRPC_OK = 0
_GRPC_PERMISSION_DENIED = 7
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14
_EMPTY: Mapping[str, str] = {}


def raw_request(req: auth_pb2.CheckRequest, needed: frozenset[str], namespace: str) -> RawRequest:
    attrs = req.attributes
    http = attrs.request.http
    headers = http.headers
    path = http.path
    q = path.find("?")
    if q >= 0:
        path = path[:q]
    route_tier: str | None = None
    fm = attrs.route_metadata_context.filter_metadata
    if namespace in fm:
        value = fm[namespace].fields.get("tier")
        if value is not None and value.WhichOneof("kind") == "string_value":
            route_tier = value.string_value
    ext = attrs.context_extensions
    return RawRequest(
        method=http.method,
        path=path,
        host=http.host,
        headers={h: headers[h] for h in needed if h in headers},
        source_ip=attrs.source.address.socket_address.address,
        route_tier=route_tier,
        context_extensions=dict(ext) if ext else _EMPTY,
        request_id=headers.get("x-request-id", ""),
    )


def _header(key: str, value: str) -> core_pb2.HeaderValueOption:
    return core_pb2.HeaderValueOption(
        header=core_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE
    )


def lease_metadata(decision: Decision, ctx: RequestContext) -> struct_pb2.Struct | None:
    if not decision.leases:
        return None
    md = struct_pb2.Struct()
    md.update({"lease_id": decision.lease_id, "leases": list(decision.leases)})
    return md


def check_response(ctx: RequestContext, decision: Decision) -> auth_pb2.CheckResponse:
    if decision.allowed:
        resp = auth_pb2.CheckResponse(
            status=status_pb2.Status(code=_GRPC_OK),
            ok_response=auth_pb2.OkHttpResponse(
                headers=[_header(TIER_HEADER, ctx.tier.value)],
                response_headers_to_add=[_header(k, v) for k, v in ratelimit_headers(decision)],
            ),
        )
        md = lease_metadata(decision, ctx)
        if md is not None:
            resp.dynamic_metadata.CopyFrom(md)
        return resp
    d = denial(ctx, decision)
    code = _GRPC_RESOURCE_EXHAUSTED if d.status == 429 else _GRPC_UNAVAILABLE
    return auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code, message=decision.denied_by.reason if decision.denied_by else ""),
        denied_response=auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=d.status),  # type: ignore[arg-type]
            headers=[_header(k, v) for k, v in d.headers],
            body=d.body,
        ),
    )


def lease_release(md: struct_pb2.Struct) -> tuple[list[str], str] | None:
    """The (lease keys, lease id) a CheckResponse put in dynamic metadata, if any."""
    fields = md.fields
    lid = fields.get("lease_id")
    keys = fields.get("leases")
    if lid is None or keys is None or lid.WhichOneof("kind") != "string_value":
        return None
    if keys.WhichOneof("kind") != "list_value":
        return None
    out = [v.string_value for v in keys.list_value.values if v.WhichOneof("kind") == "string_value"]
    return (out, lid.string_value) if out and lid.string_value else None
