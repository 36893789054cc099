"""Envoy's HTTP authorization protocol end to end: envoy/envoy-http.yaml in front of
``extauthz serve --http-listen`` (the quick start's ``demo --protocol http`` stack)."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def write_policy(directory: Path) -> Path:
    """The quick start's identity, test mode and rules, with small limits per path."""
    directory.mkdir(parents=True, exist_ok=True)
    quick = yaml.safe_load((ROOT / "policies" / "api.yaml").read_text())
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": quick["identity"],
        "test_mode": quick["test_mode"],
        "classification": quick["classification"],
        "limiters": [
            {"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 3,
             "applies_to": {"path_prefix": "/v1/rate"}},
            {"name": "user-concurrency", "type": "concurrent_requests", "limit": 2, "lease_ttl": "60s",
             "applies_to": {"path_prefix": "/v1/cc"}},
            {"name": "fleet", "type": "fleet_usage", "capacity": 2, "reserved_for_critical": 0.5,
             "applies_to": {"path_prefix": "/v1/fleet"}},
        ],
    }))
    return directory


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack([write_policy(tmp_path_factory.mktemp("http"))], protocol="http") as s:
        yield s


def status_of(stack: Stack) -> dict[str, Any]:
    assert stack.server is not None
    with _OPENER.open(f"http://127.0.0.1:{stack.server.admin_port}/status", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def echoed(result: Any) -> dict[str, Any]:
    return result.json()["headers"]  # type: ignore[no-any-return]


def test_allowed_carries_tier_upstream_and_ratelimit_to_the_client(stack: Stack, client: HttpClient) -> None:
    r = client.send(stack.url + "/v1/rate/customers", headers={"x-api-key": "sk_live_allowed"})
    assert r.status == 200
    assert r.tier == "get"  # the upstream got x-extauthz-tier
    assert r.headers["ratelimit-policy"] == '"user-rate";q=3;w=3'
    assert r.headers["ratelimit"].startswith('"user-rate";r=2;')
    # lease and route-tier headers stay between Envoy and the server
    upstream_saw = echoed(r)
    assert not any(k.startswith(("x-extauthz-lease", "x-extauthz-route")) for k in [*r.headers, *upstream_saw])
    assert "x-envoy-auth-failure-mode-allowed" not in upstream_saw


def test_refused_429_with_retry_after_and_problem_json(stack: Stack, client: HttpClient) -> None:
    key = {"x-api-key": "sk_live_greedy"}
    results = [client.send(stack.url + "/v1/rate/customers", headers=key) for _ in range(4)]
    assert [r.status for r in results] == [200, 200, 200, 429]
    refused = results[-1]
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["ratelimit"].startswith('"user-rate";r=0;')
    body = refused.json()
    assert isinstance(body, dict)
    assert body["status"] == 429 and body["limiter"] == "user-rate" and body["tier"] == "get"
    assert body["request_id"]  # Envoy's x-request-id reached the server


def test_shedder_refusal_reaches_the_client_as_503(stack: Stack, client: HttpClient) -> None:
    # fleet: capacity 2, half reserved for critical -> one non-critical request in flight
    with ThreadPoolExecutor(1) as pool, HttpClient() as other:
        slow = pool.submit(other.send, stack.url + "/v1/fleet/slow?delay=1.5", "GET", {"x-api-key": "sk_live_f1"})
        deadline = time.monotonic() + 5
        while stack.upstream is not None and stack.upstream.inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = client.send(stack.url + "/v1/fleet/x", headers={"x-api-key": "sk_live_f2"})
        critical = client.send(stack.url + "/v1/fleet/x", "POST", {"x-api-key": "sk_live_f2",
                                                                   "x-extauthz-route-tier": "critical"})
        assert slow.result().status == 200
    assert refused.status == 503
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["retry-after"]
    body = refused.json()
    assert isinstance(body, dict) and body["status"] == 503 and body["limiter"] == "fleet"
    # a client-sent route tier does not buy the reserved share
    assert critical.status == 503


def test_route_tagged_critical_and_client_tier_header_ignored(stack: Stack, client: HttpClient) -> None:
    tagged = client.send(stack.url + "/v1/refunds", "POST", {"x-api-key": "sk_live_t"})
    assert tagged.status == 200 and tagged.tier == "critical"
    spoofed = client.send(stack.url + "/v1/customers", headers={"x-api-key": "sk_live_t",
                                                                "x-extauthz-route-tier": "critical",
                                                                "x-extauthz-tier": "critical"})
    assert spoofed.status == 200 and spoofed.tier == "get"
    # a route tag wins over what the client sent
    downgraded = client.send(stack.url + "/v1/reports/daily", headers={"x-api-key": "sk_live_t",
                                                                       "x-extauthz-route-tier": "critical"})
    assert downgraded.tier == "get"
    # the policy's rules still classify untagged routes (POST /v1/charges is critical)
    assert client.send(stack.url + "/v1/charges", "POST", {"x-api-key": "sk_live_t"}).tier == "critical"


def test_test_mode_key_is_test_tier(stack: Stack, client: HttpClient) -> None:
    r = client.send(stack.url + "/v1/charges", "POST", {"x-api-key": "sk_test_carol"})
    assert r.status == 200 and r.tier == "test"
    r = client.send(stack.url + "/v1/customers", headers={"authorization": "Bearer sk_test_dan"})
    assert r.status == 200 and r.tier == "test"


def test_concurrency_leases_released_by_the_access_log(stack: Stack, client: HttpClient) -> None:
    def released_by_access_log() -> int:
        return int(status_of(stack)["lease_releases"]["by_path"]["access_log"]["released"])

    before = released_by_access_log()
    key = {"x-api-key": "sk_live_cc"}
    # limit 2: sequential requests only pass if each lease is given back by the access log
    # (the lease TTL is 60 s)
    results = []
    for _ in range(6):
        results.append(client.send(stack.url + "/v1/cc/x", headers=key).status)
        deadline = time.monotonic() + 5
        while status_of(stack)["store"]["live_leases"] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert results == [200] * 6
    assert released_by_access_log() >= before + 6  # one release call per finished request
    assert not status_of(stack)["store"]["live_leases"]
    # and in flight they do count: 3 at once -> one refused
    with ThreadPoolExecutor(3) as pool:
        statuses = sorted(pool.map(lambda _: client.send(stack.url + "/v1/cc/slow?delay=1", headers=key).status,
                                   range(3)))
    assert statuses == [200, 200, 429]


def test_source_ip_is_the_address_envoy_saw(stack: Stack, client: HttpClient) -> None:
    # no key: the identity is the source IP; a spoofed x-forwarded-for entry does not change it
    a = client.send(stack.url + "/v1/rate/anon", headers={"x-forwarded-for": "203.0.113.1"})
    b = client.send(stack.url + "/v1/rate/anon", headers={"x-forwarded-for": "203.0.113.2"})
    assert a.status == b.status == 200
    assert a.headers["ratelimit"].startswith('"user-rate";r=2;')
    assert b.headers["ratelimit"].startswith('"user-rate";r=1;')  # same bucket: 127.0.0.1


def test_server_down_fails_open(tmp_path: Path) -> None:
    with Stack([write_policy(tmp_path / "p")], protocol="http") as s, HttpClient() as c:
        assert s.server is not None
        s.server.stop()
        r = c.send(s.url + "/v1/rate/x", headers={"x-api-key": "sk_live_down", "x-extauthz-tier": "critical"})
        assert r.status == 200
        assert echoed(r).get("x-envoy-auth-failure-mode-allowed") == "true"
        # failing open sets no tier, and a client's own copy never reaches the upstream
        assert "x-extauthz-tier" not in echoed(r)


def test_a_5xx_from_the_server_fails_open(tmp_path: Path) -> None:
    """Envoy's HTTP client treats a 5xx answer (a bug of ours answers 500) as an error, not a
    denial: with the shipped failure_mode_allow the request goes through, and the tier the
    broken answer carried does not reach the upstream."""
    with Stack([write_policy(tmp_path / "p")], protocol="http") as s, HttpClient() as c:
        assert s.server is not None
        s.server.stop()

        asked: list[str] = []

        class Broken(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked.append(self.path)
                body = b"internal error"
                self.send_response(500)
                self.send_header("x-extauthz-tier", "critical")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        broken = http.server.ThreadingHTTPServer(("127.0.0.1", s.http_port), Broken)
        threading.Thread(target=broken.serve_forever, daemon=True).start()
        try:
            r = c.send(s.url + "/v1/rate/x", headers={"x-api-key": "sk_live_5xx", "x-extauthz-tier": "critical"})
        finally:
            broken.shutdown()
            broken.server_close()
        assert asked == ["/v1/rate/x"]  # Envoy asked the broken server, which answered 500
        assert r.status == 200
        assert echoed(r).get("x-envoy-auth-failure-mode-allowed") == "true"
        assert "x-extauthz-tier" not in echoed(r)


# ---- identity from a JWT verified by Envoy (jwt_authn forward_payload_header) -----------

JWT_POLICY = {
    "version": 1,
    "identity": [
        {"metadata": {"namespace": "envoy.filters.http.jwt_authn", "path": ["payload", "sub"]}},
        {"header": "x-api-key"},
        {"source_ip": True},
    ],
    "limiters": [{"name": "per-user", "type": "request_rate", "rate": "1/h", "burst": 2}],
}


def http_jwt_config(jwks: str) -> dict[str, Any]:
    """envoy-http.yaml's options with envoy-jwt.yaml's jwt_authn issuer (trusting ``jwks``):
    the generator puts its filter right after the filter that strips client-sent x-jwt-payload,
    forwarding the verified payload."""
    from .test_identity_e2e import shipped_provider

    filters = yaml.safe_load((ROOT / "envoy" / "envoy-http.yaml").read_text())[
        "static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    assert filters[0]["name"] == "extauthz.strip-route-tier"
    return {"jwt": shipped_provider(jwks)}


def test_jwt_payload_forwarded_by_jwt_authn_names_the_user(tmp_path: Path) -> None:
    from .test_identity_e2e import Issuer

    issuer = Issuer()
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(JWT_POLICY))
    with Stack([tmp_path / "policy.yaml"], protocol="http", tracing=None, **http_jwt_config(issuer.jwks())) as s, \
            HttpClient() as c:
        def send(headers: dict[str, str]) -> int:
            return c.send(s.url + "/v1/things", headers=headers).status

        alice = {"authorization": f"Bearer {issuer.token('alice')}"}
        bob = {"authorization": f"Bearer {issuer.token('bob')}"}
        # the subject names the user: alice's bucket (burst 2) is hers alone
        assert [send(alice) for _ in range(3)] == [200, 200, 429]
        assert send(bob) == 200
        # a fresh token for alice is still alice
        assert send({"authorization": f"Bearer {issuer.token('alice')}"}) == 429
        # a client-sent payload header without a token is stripped: it names nobody, the
        # next rule (x-api-key) does
        import base64
        forged = base64.urlsafe_b64encode(json.dumps({"sub": "bob"}).encode()).decode()
        assert [send({"x-jwt-payload": forged, "x-api-key": "sk_live_carol"}) for _ in range(3)] == [200, 200, 429]
        assert send(bob) == 200  # bob's bucket was not touched by the forgery
        # a token Envoy cannot verify never reaches the server
        other = Issuer(kid="test")
        assert send({"authorization": f"Bearer {other.token('alice')}"}) == 401


def test_client_sent_identity_headers_are_stripped(stack: Stack, client: HttpClient) -> None:
    # on a plaintext listener Envoy sanitizes a client's x-forwarded-client-cert and the first
    # filter removes x-jwt-payload: neither reaches the upstream (nor the check built from the
    # same headers)
    forged = {"x-api-key": "sk_live_xf", "x-forwarded-client-cert": "URI=spiffe://cluster.local/ns/a/sa/admin",
              "x-jwt-payload": "eyJzdWIiOiJib2IifQ"}
    r = client.send(stack.url + "/v1/customers", headers=forged)
    assert r.status == 200
    assert "x-forwarded-client-cert" not in echoed(r) and "x-jwt-payload" not in echoed(r)
