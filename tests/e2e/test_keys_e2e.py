"""Limiter keys and a quota through a real Envoy, on both of its authorization protocols
(envoy/envoy.yaml over gRPC, envoy/envoy-http.yaml over HTTP): every request reaches the
server from Envoy's one client address, so a per-IP key counts them all together."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

pytestmark = pytest.mark.e2e


def write_policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}, {"source_ip": True}],
        "limiters": [
            {"name": "login-per-ip", "type": "request_rate", "rate": 0.001, "burst": 3,
             "key": [{"source_ip": True}], "applies_to": {"path_prefix": "/v1/login"}},
            {"name": "per-user-method", "type": "request_rate", "rate": 0.001, "burst": 1,
             "key": [{"identity": True}, {"method": True}], "applies_to": {"path_prefix": "/v1/items"}},
            {"name": "per-key", "type": "request_rate", "rate": 0.001, "burst": 1,
             "key": [{"header": "x-api-key"}], "applies_to": {"path_prefix": "/v1/keyed"}},
            {"name": "daily", "type": "quota", "limit": 2, "period": "day",
             "applies_to": {"path_prefix": "/v1/quota"}},
        ],
    }))
    return directory


@pytest.fixture(scope="module", params=["grpc", "http"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack([write_policy(tmp_path_factory.mktemp("keys"))], protocol=request.param) as s:
        yield s


def statuses(stack: Stack, client: HttpClient, path: str, method: str = "GET",
             keys: list[str | None] | None = None) -> list[int]:
    return [client.send(stack.url + path, method, headers={"x-api-key": k} if k else {}).status
            for k in keys or []]


def test_one_address_with_many_api_keys_hits_the_per_ip_limit(stack: Stack, client: HttpClient) -> None:
    assert statuses(stack, client, "/v1/login", "POST", [f"sk_live_{i}" for i in range(4)]) == [200] * 3 + [429]


def test_get_and_post_of_one_user_count_apart(stack: Stack, client: HttpClient) -> None:
    assert statuses(stack, client, "/v1/items", "GET", ["sk_live_m", "sk_live_m"]) == [200, 429]
    assert statuses(stack, client, "/v1/items", "POST", ["sk_live_m", "sk_live_m"]) == [200, 429]


def test_a_request_without_the_keyed_header_is_not_limited(stack: Stack, client: HttpClient) -> None:
    assert statuses(stack, client, "/v1/keyed", "GET", [None, None, None]) == [200, 200, 200]
    assert statuses(stack, client, "/v1/keyed", "GET", ["sk_live_k", "sk_live_k"]) == [200, 429]


def test_a_quota_refuses_with_retry_after_at_the_end_of_the_day(stack: Stack, client: HttpClient) -> None:
    results = [client.send(stack.url + "/v1/quota", headers={"x-api-key": "sk_live_q"}) for _ in range(3)]
    assert [r.status for r in results] == [200, 200, 429]
    refused = results[2]
    assert abs(int(refused.headers["retry-after"]) - (86400 - time.time() % 86400)) <= 5
    assert refused.headers["ratelimit-policy"] == '"daily";q=2;w=86400'
    body = refused.json()
    assert isinstance(body, dict) and body["limiter"] == "daily" and body["reset"].endswith("T00:00:00Z")


def repeated(stack: Stack, path: str, values: list[str]) -> int:
    """One request carrying ``x-api-key`` once per value (as separate header lines)."""
    parts = urlsplit(stack.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        conn.putrequest("GET", path)
        for value in values:
            conn.putheader("x-api-key", value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_repeated_key_header_is_one_value_or_the_shared_ambiguous_one(stack: Stack, client: HttpClient) -> None:
    # Issue 29: Envoy joins a repeated header with "," on either protocol; `sk,sk` was a
    # bucket of its own beside `sk`, so repeating the header gave a fresh bucket
    assert statuses(stack, client, "/v1/keyed", "GET", ["sk_live_r"]) == [200]
    assert repeated(stack, "/v1/keyed", ["sk_live_r", " sk_live_r"]) == 429
    assert repeated(stack, "/v1/keyed", ["sk_live_x", "sk_live_y"]) == 200
    assert repeated(stack, "/v1/keyed", ["sk_live_y", "sk_live_z"]) == 429  # one bucket for all such
