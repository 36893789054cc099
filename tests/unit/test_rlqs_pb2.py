"""The rate limit quota service's protobuf subset, pinned to what Envoy 1.40.0 sends.

Envoy 1.40.0 sends ``repeated BucketQuotaUsage bucket_quota_usages = 2`` (a later revision on
Envoy's main branch has a ``map<uint64, BucketQuotaUsage>`` there): the bytes below are built
field by field as the 1.40 layout puts them on the wire, without our classes, and decoded by
them. The e2e test through the real Envoy 1.40 (tests/e2e/test_rlqs_envoy.py) reads its reports.
"""

from __future__ import annotations

from google.protobuf import descriptor as _descriptor

from extauthz.proto import ratelimit_strategy_pb2, rlqs_pb2, rlqs_pb2_grpc

FD = _descriptor.FieldDescriptor


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2), lengths under 128."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _varint_field(number: int, value: int) -> bytes:
    assert value < 128
    return bytes([number << 3, value])


def test_service_path_and_streaming() -> None:
    svc = rlqs_pb2.DESCRIPTOR.services_by_name["RateLimitQuotaService"]
    assert svc.full_name == "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
    method = svc.methods_by_name["StreamRateLimitQuotas"]
    assert method.client_streaming and method.server_streaming
    assert hasattr(rlqs_pb2_grpc, "add_RateLimitQuotaServiceServicer_to_server")
    assert rlqs_pb2.DESCRIPTOR.name == "extauthz_wire/rlqs.proto"


def test_envoy_140_report_layout_decodes() -> None:
    bucket_id = _field(1, _field(1, b"limiter") + _field(2, b"per-ip"))  # one map entry
    usage = (_field(1, bucket_id) + _field(2, _varint_field(1, 5))  # time_elapsed 5 s
             + _varint_field(3, 7) + _varint_field(4, 2))
    wire = _field(1, b"edge") + _field(2, usage) + _field(2, usage)
    report = rlqs_pb2.RateLimitQuotaUsageReports.FromString(wire)
    assert report.domain == "edge"
    assert len(report.bucket_quota_usages) == 2
    first = report.bucket_quota_usages[0]
    assert dict(first.bucket_id.bucket) == {"limiter": "per-ip"}
    assert first.time_elapsed.seconds == 5
    assert (first.num_requests_allowed, first.num_requests_denied) == (7, 2)


def test_field_numbers() -> None:
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage.DESCRIPTOR
    assert [(f.name, f.number) for f in usage.fields] == [
        ("bucket_id", 1), ("time_elapsed", 2), ("num_requests_allowed", 3), ("num_requests_denied", 4)]
    reports = rlqs_pb2.RateLimitQuotaUsageReports.DESCRIPTOR
    usages = reports.fields_by_name["bucket_quota_usages"]
    assert usages.number == 2 and usages.is_repeated
    assert usages.message_type is usage  # not a map entry (the later revision)
    action = rlqs_pb2.RateLimitQuotaResponse.BucketAction.DESCRIPTOR
    assert [(f.name, f.number) for f in action.fields] == [
        ("bucket_id", 1), ("quota_assignment_action", 2), ("abandon_action", 3)]
    assign = rlqs_pb2.RateLimitQuotaResponse.BucketAction.QuotaAssignmentAction.DESCRIPTOR
    assert [(f.name, f.number) for f in assign.fields] == [
        ("assignment_time_to_live", 2), ("rate_limit_strategy", 3)]
    strategy = ratelimit_strategy_pb2.RateLimitStrategy.DESCRIPTOR
    assert strategy.full_name == "envoy.type.v3.RateLimitStrategy"
    assert [(f.name, f.number) for f in strategy.fields] == [("blanket_rule", 1), ("token_bucket", 3)]
    bucket = ratelimit_strategy_pb2.TokenBucket.DESCRIPTOR
    assert [(f.name, f.number) for f in bucket.fields] == [
        ("max_tokens", 1), ("tokens_per_fill", 2), ("fill_interval", 3)]
    assert ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL == 1
