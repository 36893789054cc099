"""The fast CheckResponse building in server/edge.py answers exactly what the plain,
message-by-message construction answers (the reference below), for every tier and for
allowed, refused, leased and shadow decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format, struct_pb2

from extauthz.core.clock import ManualClock
from extauthz.core.context import RequestContext
from extauthz.core.verdict import Decision
from extauthz.engine.answers import LEASE_ID_FIELD, LEASES_FIELD, denial, ratelimit_headers, read_lease_fields
from extauthz.proto import auth_pb2, core_pb2, status_pb2
from extauthz.server.edge import TIER_HEADER, check_response, lease_metadata

from .helpers import engine_for, get, policy_from

_OVERWRITE = core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> core_pb2.HeaderValueOption:
    return core_pb2.HeaderValueOption(header=core_pb2.HeaderValue(key=key, value=value),
                                      append_action=_OVERWRITE)


def reference(ctx: RequestContext, decision: Decision) -> auth_pb2.CheckResponse:
    if decision.allowed:
        resp = auth_pb2.CheckResponse(
            status=status_pb2.Status(code=0),
            ok_response=auth_pb2.OkHttpResponse(
                headers=[_header(TIER_HEADER, ctx.tier.value)],
                response_headers_to_add=[_header(k, v) for k, v in ratelimit_headers(decision)],
            ),
        )
        if decision.leases:
            md = struct_pb2.Struct()
            md.update({"x-extauthz-lease-id": decision.lease_id,
                       "x-extauthz-leases": ",".join(decision.leases)})
            resp.dynamic_metadata.CopyFrom(md)
        return resp
    # a refusal, written as Envoy's JSON form of the message (google.rpc codes: 8
    # RESOURCE_EXHAUSTED for a 429, 14 UNAVAILABLE for a shed 503)
    d = denial(ctx, decision)
    return json_format.ParseDict({
        "status": {"code": 8 if d.status == 429 else 14,
                   "message": decision.denied_by.reason if decision.denied_by else ""},
        "deniedResponse": {
            "status": {"code": d.status},
            "headers": [{"header": {"key": k, "value": v}, "appendAction": "OVERWRITE_IF_EXISTS_OR_ADD"}
                        for k, v in d.headers],
            "body": d.body,
        },
    }, auth_pb2.CheckResponse())


POLICY = {
    "test_mode": {"key_prefix": "sk_test_"},
    "classification": {"rules": [{"match": {"methods": ["POST"], "path_prefix": "/v1/charges"},
                                  "tier": "critical"}]},
    "limiters": [
        {"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 2},
        {"name": "user-concurrency", "type": "concurrent_requests", "limit": 3},
        {"name": "fleet", "type": "fleet_usage", "capacity": 100},
        {"name": "shadow-rate", "type": "request_rate", "rate": 1, "burst": 1, "mode": "shadow"},
    ],
}


@pytest.mark.parametrize("raw", [
    get(), get(key="sk_test_bob"), get(method="POST", path="/v1/charges"),
    get(method="POST", path="/v1/other"), get(key=""),
])
async def test_check_response_matches_reference(tmp_path: Path, clock: ManualClock, raw: object) -> None:
    engine, _ = engine_for(policy_from(tmp_path, POLICY), clock)
    seen_allowed = seen_denied = False
    for _ in range(4):  # allowed with leases, then refused by the bucket
        ctx, decision = await engine.check(raw)  # type: ignore[arg-type]
        assert check_response(ctx, decision) == reference(ctx, decision)
        assert check_response(ctx, decision).SerializeToString(deterministic=True) == \
            reference(ctx, decision).SerializeToString(deterministic=True)
        seen_allowed |= decision.allowed
        seen_denied |= not decision.allowed
        if decision.leases:  # what the access log hands back is what the answer carried
            md = check_response(ctx, decision).dynamic_metadata
            assert lease_release(md) == (list(decision.leases), decision.lease_id)
    assert seen_allowed and seen_denied


async def test_no_limiters_no_metadata(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": []}), clock)
    ctx, decision = await engine.check(get())
    resp = check_response(ctx, decision)
    assert resp == reference(ctx, decision)
    assert not resp.HasField("dynamic_metadata")
    assert [h.header.key for h in resp.ok_response.headers] == [TIER_HEADER]


def lease_release(md: struct_pb2.Struct) -> tuple[list[str], str] | None:
    """The (keys, lease id) the access log's entry handling reads from what the gRPC edge
    hands it (leases.FinishedEntries.entry)."""
    fields = lease_metadata(md)
    return read_lease_fields(fields.get(LEASE_ID_FIELD), fields.get(LEASES_FIELD))


def test_lease_release_ignores_malformed_metadata() -> None:
    md = struct_pb2.Struct()
    assert lease_release(md) is None
    md.update({"x-extauthz-lease-id": 5, "x-extauthz-leases": "a"})
    assert lease_release(md) is None
    md = struct_pb2.Struct()
    md.update({"x-extauthz-lease-id": "x", "x-extauthz-leases": ["a"]})
    assert lease_release(md) is None
    md = struct_pb2.Struct()
    md.update({"x-extauthz-lease-id": "", "x-extauthz-leases": "a"})
    assert lease_release(md) is None
    md = struct_pb2.Struct()
    md.update({"x-extauthz-lease-id": "x", "x-extauthz-leases": ",k,"})
    assert lease_release(md) == (["k"], "x")


def test_header_numbers_are_bounded_whatever_a_limiter_computed() -> None:
    # burst=1e308,cost=1e308 once answered 429 with a 309-digit Retry-After; inf and NaN
    # raised in math.floor/ceil. The policy's bounds keep such numbers out; these are the
    # last line: every header number is an integer of at most 10 digits.
    from extauthz.core.verdict import Kind, Outcome, Quota, Tier, Verdict
    from extauthz.engine.answers import MAX_HEADER_COUNT, MAX_HEADER_SECONDS

    ctx = RequestContext(tier=Tier.GET, identity="a" * 24, identity_source="header:x-api-key",
                         test_mode=False, method="GET", path="/", host="h", tier_source="default")
    for huge in (1e308, float("inf"), float("nan")):
        v = Verdict("user-rate", Kind.RATE_LIMITER, Outcome.DENIED, limit=1e308, remaining=huge,
                    retry_after=huge, reset=huge, quota=Quota(limit=huge, window=huge))
        d = denial(ctx, Decision(False, ctx.tier, (v,), denied_by=v))
        headers = dict(d.headers)
        assert headers["retry-after"] == str(MAX_HEADER_SECONDS) == "31622400"  # 366 days: a leap year
        q = "0" if huge != huge else str(MAX_HEADER_COUNT)
        assert headers["ratelimit-policy"] == f'"user-rate";q={q};w={MAX_HEADER_SECONDS}'
        assert headers["ratelimit"] == f'"user-rate";r={q};t={MAX_HEADER_SECONDS}'
        assert '"retry_after":31622400' in d.body and '"limit":1000000000' in d.body
