"""The HTTP edge's conversions: request headers -> RawRequest, Decision -> HTTP answer."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.settings import path_prefix
from extauthz.engine.answers import LEASE_ID_FIELD, LEASES_FIELD, lease_fields, read_lease_fields
from extauthz.envoy.headers import SHED_STATUS, allowed_headers, unreadable_over_http
from extauthz.server.httpmap import (
    http_answer,
    jwt_payload,
    raw_request,
    source_ip,
    xfcc_principal,
)

from .helpers import engine_for, get, policy_from


def test_raw_request_reads_path_host_route_tier_and_request_id() -> None:
    headers = {"host": "api.example.com", "x-api-key": "k", "x-other": "o", "x-request-id": "rid",
               "x-extauthz-route-tier": "critical", "x-forwarded-for": "203.0.113.9, 10.0.0.7"}
    raw = raw_request("POST", "/v1/charges?x=1", headers, frozenset({"x-api-key", "x-missing"}))
    assert (raw.method, raw.path, raw.host) == ("POST", "/v1/charges", "api.example.com")
    assert raw.headers == {"x-api-key": "k"}  # only what the policy reads
    assert (raw.route_tier, raw.request_id, raw.source_ip) == ("critical", "rid", "10.0.0.7")
    assert raw.context_extensions == {}


def test_source_ip_is_the_last_forwarded_for_entry() -> None:
    assert source_ip("") == ""
    assert source_ip("10.0.0.1") == "10.0.0.1"
    assert source_ip("1.1.1.1, 2.2.2.2,3.3.3.3 ") == "3.3.3.3"


def test_xfcc_principal_takes_the_last_element_uri() -> None:
    assert xfcc_principal("") == ""
    assert xfcc_principal('By=spiffe://a;Hash=ab;Subject="CN=x,O=y";URI=spiffe://cluster.local/ns/a/sa/b') == \
        "spiffe://cluster.local/ns/a/sa/b"
    # two hops: the last element is the peer Envoy authenticated
    assert xfcc_principal('URI=spiffe://client;DNS=a,By=x;URI="spiffe://peer"') == "spiffe://peer"
    assert xfcc_principal("Hash=ab;DNS=example.com") == ""


def test_jwt_payload_decodes_base64url_json_objects_only() -> None:
    claims = {"sub": "user-1", "n": 5}
    enc = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    assert jwt_payload(enc) == claims
    assert jwt_payload("") is None
    assert jwt_payload("!!!") is None
    assert jwt_payload(base64.urlsafe_b64encode(b"[1]").decode()) is None
    assert jwt_payload("a" * 20_000) is None


def test_allowed_headers_drops_what_envoy_always_sends() -> None:
    out = allowed_headers({"Authorization", "x-api-key", "host"})
    assert out[0] == "x-api-key" and "authorization" not in out and "host" not in out
    assert len(out) == len(set(out))


def test_allowed_headers_for_grpc_lists_authorization_and_the_request_id() -> None:
    assert allowed_headers({"Authorization", "x-plan", "X-Request-Id"}, "grpc") == [
        "authorization", "x-plan", "x-request-id"]
    with pytest.raises(ValueError, match="protocol"):
        allowed_headers({"x-api-key"}, "grpcs")


def test_lease_fields_round_trip() -> None:
    from extauthz.core.tiers import Tier
    from extauthz.core.verdict import Decision

    d = Decision(allowed=True, tier=Tier.GET, leases=("p:{u:1}:cc:a", "p:{fleet}:fl:f:other"), lease_id="id1")
    fields = dict(lease_fields(d))
    assert fields == {LEASE_ID_FIELD: "id1", LEASES_FIELD: "p:{u:1}:cc:a,p:{fleet}:fl:f:other"}
    assert read_lease_fields(fields[LEASE_ID_FIELD], fields[LEASES_FIELD]) == (list(d.leases), "id1")
    assert lease_fields(Decision(allowed=True, tier=Tier.GET)) == []
    assert dict(lease_fields(d, "t1"))["x-extauthz-lease-ticket"] == "t1"
    assert read_lease_fields(None, "a") is None and read_lease_fields("x", "") is None


async def test_http_answer_allowed_and_refused(tmp_path: Path) -> None:
    clock = ManualClock()
    policy = policy_from(tmp_path, {"limiters": [
        {"name": "r", "type": "request_rate", "rate": 1, "burst": 1},
        {"name": "fleet", "type": "fleet_usage", "capacity": 1, "reserved_for_critical": 0.5,
         "applies_to": {"path_prefix": "/fleet"}}]})
    engine, _ = engine_for(policy, clock)
    ctx, ok = await engine.check(get())
    text = http_answer(ctx, ok).decode()
    assert text.startswith("HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-extauthz-tier: get\r\n")
    assert "ratelimit: " in text and "connection: close" not in text
    ctx, refused = await engine.check(get())
    text = http_answer(ctx, refused, close=True).decode()
    head, body = text.split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 429 ") and "retry-after: 1" in head and "connection: close" in head
    assert f"content-length: {len(body.encode())}" in head and json.loads(body)["limiter"] == "r"
    ctx, held = await engine.check(get("/fleet/x", key="sk_live_other"))
    assert held.allowed and b"x-extauthz-leases: " in http_answer(ctx, held)
    ctx, shed = await engine.check(get("/fleet/x", key="sk_live_third"))
    assert shed.http_status == 503
    assert http_answer(ctx, shed).startswith(b"HTTP/1.1 %d " % SHED_STATUS)


def test_http_metadata_files_the_forwarded_jwt_payload_like_jwt_authn() -> None:
    from extauthz.envoy.headers import JWT_NAMESPACE
    from extauthz.server.httpmap import http_metadata

    claims = {"sub": "alice", "n": 7, "livemode": False, "nested": {"team": "t1"}, "big": "x" * 100}
    header = {"x-jwt-payload": base64.urlsafe_b64encode(json.dumps(claims).encode()).decode()}
    needed = {JWT_NAMESPACE: [("payload", "sub"), ("payload", "n"), ("payload", "livemode"),
                              ("payload", "nested", "team"), ("payload", "missing")]}
    assert http_metadata(header, needed) == {JWT_NAMESPACE: {"payload": {
        "sub": "alice", "n": 7.0, "livemode": False, "nested": {"team": "t1"}}}}
    assert http_metadata(header, {}) == {}  # the policy reads no JWT: nothing decoded
    assert http_metadata({"x-jwt-payload": "not base64!"}, needed) == {}
    assert http_metadata({}, needed) == {}


def test_forward_auth_reads_the_forwarded_request_only_when_asked() -> None:
    headers = {"host": "authz:9003", "x-forwarded-method": "POST", "x-forwarded-uri": "/v1/charges?a=1",
               "x-forwarded-host": "api.example.com"}
    plain = raw_request("GET", "/", headers, frozenset())
    assert (plain.method, plain.path, plain.host) == ("GET", "/", "authz:9003")
    fwd = raw_request("GET", "/", headers, frozenset(), forward_auth=True)
    assert (fwd.method, fwd.path, fwd.host) == ("POST", "/v1/charges", "api.example.com")


@pytest.mark.parametrize(("target", "path"), [
    ("/auth/v1/charges?a=1", "/v1/charges"),  # Envoy Gateway: extAuth.http.path + the client's path
    ("/auth", "/"),
    ("/auth/", "/"),
    ("/auth/auth/x", "/auth/x"),  # the client's own /auth/x, prefixed once
    ("/v1/charges", "/v1/charges"),  # without the prefix: taken as it is
    ("/authors/1", "/authors/1"),  # the prefix is only the start of a segment: not it
])
def test_http_path_prefix_is_removed_before_classifying(target: str, path: str) -> None:
    for method in ("GET", "POST", "DELETE", "PATCH", "OPTIONS"):
        raw = raw_request(method, target, {"host": "api.example.com"}, frozenset(), prefix="/auth")
        assert (raw.method, raw.path) == (method, path)
    assert raw_request("GET", target, {}, frozenset()).path == target.split("?")[0]  # no prefix set


@pytest.mark.parametrize(("value", "normalized"), [("", ""), ("/", ""), ("/auth/", "/auth"), ("/a/b", "/a/b")])
def test_http_path_prefix_values(value: str, normalized: str) -> None:
    assert path_prefix(value) == normalized


@pytest.mark.parametrize("value", ["auth", "/auth?x=1", "/a#b", "/a b"])
def test_bad_http_path_prefix_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="path such as /auth"):
        path_prefix(value)


#: a policy reading, per limiter, one thing the HTTP protocol carries and one it does not
UNREADABLE = {
    "identity": [{"metadata": {"namespace": "envoy.filters.http.jwt_authn", "path": ["payload", "sub"]}},
                 {"metadata": {"namespace": "corp.authn", "path": ["user"]}}],
    "limiters": [
        {"name": "per-route", "type": "request_rate", "rate": 1, "burst": 1,
         "key": [{"identity": True}, {"route": True}]},
        {"name": "per-team", "type": "request_rate", "rate": 1, "burst": 1,
         "key": [{"context_extension": "team"}, {"header": "x-org"}]},
        {"name": "per-gateway-route", "type": "quota", "limit": 5, "period": "day",
         "key": [{"route_metadata": {"namespace": "envoy-gateway", "path": ["resources", 0, "name"]}}]},
        {"name": "per-ip", "type": "request_rate", "rate": 1, "burst": 1, "key": [{"source_ip": True}]},
    ],
}


def test_what_the_http_protocol_cannot_carry_is_named(tmp_path: Path) -> None:
    problems = unreadable_over_http(policy_from(tmp_path, UNREADABLE))
    assert [p.split(" yields nothing")[0] for p in problems] == [
        "limiter 'per-route': key part route",
        "limiter 'per-team': key part context_extension:team",
        "limiter 'per-gateway-route': key part route_metadata:envoy-gateway:resources.0.name",
        "metadata corp.authn:user",
    ]
    assert all("HTTP protocol" in p for p in problems)


def test_a_policy_the_http_protocol_carries_has_nothing_to_say(tmp_path: Path) -> None:
    doc = {**UNREADABLE, "identity": UNREADABLE["identity"][:1], "limiters": UNREADABLE["limiters"][3:]}
    assert unreadable_over_http(policy_from(tmp_path, doc)) == []
