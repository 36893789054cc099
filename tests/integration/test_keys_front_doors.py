"""Issue 21's "Done when" through the public interface: the gRPC and the HTTP front doors of
a running server, on the embedded store and on a real Redis. Both doors of one server share
its store, so each scenario alternates doors: a count taken on one is seen on the other."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from extauthz.proto import auth_pb2, auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from testinfra.redis_servers import RedisSingle

POLICY = """\
version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: login-per-ip, type: request_rate, rate: 0.001, burst: 5, key: [{source_ip: true}],
     applies_to: {path_prefix: /v1/login}}
  - {name: per-key, type: request_rate, rate: 0.001, burst: 5, key: [{header: x-api-key}],
     applies_to: {path_prefix: /v1/login}}
  - {name: per-user-method, type: request_rate, rate: 0.001, burst: 2,
     key: [{identity: true}, {method: true}], applies_to: {path_prefix: /v1/items}}
  - {name: per-org, type: request_rate, rate: 0.001, burst: 1, key: [{header: x-org}],
     applies_to: {path_prefix: /v1/org}}
  - {name: per-team, type: request_rate, rate: 0.001, burst: 2, key: [{header: x-team}],
     on_missing_key: shared, applies_to: {path_prefix: /v1/team}}
  - {name: daily, type: quota, limit: 3, period: day, applies_to: {path_prefix: /v1/quota}}
"""

Answer = tuple[int, dict[str, str], str]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    redis_url = None
    if request.param == "redis":
        redis: RedisSingle = request.getfixturevalue("redis_single_clean")
        redis_url = redis.url
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                              admin_listen="off", reload_interval=0, redis_url=redis_url,
                              store_deadline_ms=2000))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


class Doors:
    """One request at a time, over gRPC (even calls) and HTTP (odd calls) in turn."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.n = 0

    async def __call__(self, method: str, path: str, ip: str = "10.0.0.1", **headers: str) -> Answer:
        self.n += 1
        hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
        return await (self._grpc if self.n % 2 else self._http)(method, path, ip, hdrs)

    async def _grpc(self, method: str, path: str, ip: str, headers: dict[str, str]) -> Answer:
        req = auth_pb2.CheckRequest()
        http = req.attributes.request.http
        http.method, http.path, http.host = method, path, "api.example.com"
        http.headers.update(headers)
        req.attributes.source.address.socket_address.address = ip
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.srv.port}") as channel:
            resp = await auth_pb2_grpc.AuthorizationStub(channel).Check(req)
        if resp.WhichOneof("http_response") == "denied_response":
            d = resp.denied_response
            return d.status.code, {h.header.key: h.header.value for h in d.headers}, d.body
        return 200, {}, ""

    async def _http(self, method: str, path: str, ip: str, headers: dict[str, str]) -> Answer:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.srv.http_port)
        try:
            head = f"{method} {path} HTTP/1.1\r\nhost: api.example.com\r\nx-forwarded-for: {ip}\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write((head + "content-length: 0\r\n\r\n").encode())
            lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            out = dict(line.split(": ", 1) for line in lines[1:] if line)
            body = (await reader.readexactly(int(out.pop("content-length")))).decode()
            return int(lines[0].split()[1]), out, body
        finally:
            writer.close()


async def statuses(doors: Doors, calls: list[tuple[str, str, str, dict[str, str]]]) -> list[int]:
    return [(await doors(m, p, ip, **h))[0] for m, p, ip, h in calls]


async def test_limiters_keyed_differently_refuse_independently(server: Server) -> None:
    doors = Doors(server)
    # one client IP with five API keys (and a sixth) hits the per-IP limit
    one_ip = [("POST", "/v1/login", "10.0.0.1", {"x_api_key": f"sk_{i}"}) for i in range(6)]
    assert await statuses(doors, one_ip) == [200] * 5 + [429]
    refused = json.loads((await doors("POST", "/v1/login", "10.0.0.1", x_api_key="sk_x"))[2])
    assert refused["limiter"] == "login-per-ip"
    # one API key from five IPs (and a sixth) hits the per-key limit
    one_key = [("POST", "/v1/login", f"10.0.1.{i}", {"x_api_key": "sk_one"}) for i in range(6)]
    assert await statuses(doors, one_key) == [200] * 5 + [429]
    refused = json.loads((await doors("POST", "/v1/login", "10.0.1.9", x_api_key="sk_one"))[2])
    assert refused["limiter"] == "per-key"


async def test_a_per_user_per_method_key_keeps_get_and_post_apart(server: Server) -> None:
    doors = Doors(server)
    posts = [("POST", "/v1/items", "10.0.0.1", {"x_api_key": "sk_a"})] * 3
    gets = [("GET", "/v1/items", "10.0.0.1", {"x_api_key": "sk_a"})] * 3
    assert await statuses(doors, posts) == [200, 200, 429]
    assert await statuses(doors, gets) == [200, 200, 429]


async def test_a_missing_keyed_header_skips_or_shares(server: Server) -> None:
    doors = Doors(server)
    no_org = [("GET", "/v1/org", "10.0.0.1", {"x_api_key": "sk_a"})] * 4
    assert await statuses(doors, no_org) == [200] * 4  # skipped
    org = [("GET", "/v1/org", "10.0.0.1", {"x_api_key": "sk_a", "x_org": "acme"})] * 2
    assert await statuses(doors, org) == [200, 429]
    no_team = [("GET", "/v1/team", "10.0.0.1", {"x_api_key": f"sk_{i}"}) for i in range(3)]
    assert await statuses(doors, no_team) == [200, 200, 429]  # one shared bucket


async def test_a_quota_refuses_after_limit_with_retry_after_at_the_window_end(server: Server) -> None:
    doors = Doors(server)
    calls = [("GET", "/v1/quota", "10.0.0.1", {"x_api_key": "sk_q"})] * 4
    assert await statuses(doors, calls) == [200, 200, 200, 429]
    for _ in range(2):  # both doors
        status, headers, body = await doors("GET", "/v1/quota", x_api_key="sk_q")
        assert status == 429
        to_midnight = 86400 - time.time() % 86400
        assert abs(int(headers["retry-after"]) - to_midnight) <= 2
        assert headers["ratelimit-policy"] == '"daily";q=3;w=86400'
        assert json.loads(body)["reset"].endswith("T00:00:00Z")


NORMALISED = """\
version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: per-key, type: request_rate, rate: 0.001, burst: 1, applies_to: {path_prefix: /v1/key}}
  - {name: per-org, type: request_rate, rate: 0.001, burst: 1, key: [{header: x-org, case: fold}],
     applies_to: {path_prefix: /v1/org}}
  - {name: per-host, type: request_rate, rate: 0.001, burst: 1, key: [{host: true}],
     applies_to: {path_prefix: /v1/host}}
"""


async def _grpc_status(srv: Server, path: str, host: str, headers: dict[str, str]) -> int:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = "GET", path, host
    http.headers.update(headers)  # Envoy joins a repeated header's values with ","
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        resp = await auth_pb2_grpc.AuthorizationStub(channel).Check(req)
    return resp.denied_response.status.code if resp.WhichOneof("http_response") == "denied_response" else 200


async def _http_status(srv: Server, path: str, host: str, lines: list[tuple[str, str]]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.http_port)
    try:
        head = f"GET {path} HTTP/1.1\r\nhost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in lines)
        writer.write((head + "content-length: 0\r\n\r\n").encode())
        status = int((await reader.readuntil(b"\r\n\r\n")).split()[1])
        return status
    finally:
        writer.close()


async def test_key_values_are_normalised_the_same_through_both_doors(tmp_path: Path) -> None:
    # Issue 29: "ACME", "acme" and a repeated "acme,acme" were three buckets; every IPv6 Host
    # one bucket ("[")
    policy = tmp_path / "p.yaml"
    policy.write_text(NORMALISED)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                              admin_listen="off", reload_interval=0))
    await srv.start()
    try:
        host = "api.example.com"
        # the identity: trimmed, a repeat of one value is that value; no case folding
        assert await _grpc_status(srv, "/v1/key", host, {"x-api-key": "sk_a"}) == 200
        assert await _http_status(srv, "/v1/key", host, [("x-api-key", "sk_a"), ("x-api-key", "sk_a ")]) == 429
        assert await _grpc_status(srv, "/v1/key", host, {"x-api-key": "sk_a, sk_a"}) == 429
        assert await _http_status(srv, "/v1/key", host, [("x-api-key", "SK_A")]) == 200
        # case: fold on a key part
        assert await _http_status(srv, "/v1/org", host, [("x-org", "ACME ")]) == 200
        assert await _grpc_status(srv, "/v1/org", host, {"x-org": "acme"}) == 429
        assert await _http_status(srv, "/v1/org", host, [("x-org", "Acme"), ("x-org", "acme")]) == 429
        # different values: one bucket for all such requests, whoever sends them
        assert await _grpc_status(srv, "/v1/org", host, {"x-org": "acme,other"}) == 200
        assert await _http_status(srv, "/v1/org", host, [("x-org", "beta"), ("x-org", "gamma")]) == 429
        assert await _grpc_status(srv, "/v1/org", host, {"x-org": "beta"}) == 200
        # the Host: IPv6 literals whole, names lower case, the port and a final dot dropped
        for grpc_door, h, status in ((True, "[::1]:8080", 200), (False, "[::2]", 200), (True, "[0:0::1]", 429),
                                     (False, "[::1]:9", 429), (True, "API.Example.com", 200),
                                     (False, "api.example.com.:443", 429)):
            got = await (_grpc_status(srv, "/v1/host", h, {}) if grpc_door else _http_status(srv, "/v1/host", h, []))
            assert got == status, h
    finally:
        await srv.stop(grace=0)
