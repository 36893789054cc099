"""The HTTP port and the gRPC port give the same decision and the same headers for the same
request, over every limiter kind and outcome (docs/http.md has the mapping).

Three servers with the same policy, fresh embedded stores and one frozen clock get the same
sequence of requests, over gRPC on each gRPC server kind (``--grpc-server asyncio`` and
``grpcio``) and over HTTP; their answers are compared step by
step after the documented mapping (gRPC ``ok_response.headers`` + ``response_headers_to_add``
+ dynamic metadata <-> HTTP 200 headers; denied 503 <-> HTTP 420). Lease ids are random and
tickets keyed per process: only their presence is compared; the lease keys must be equal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from extauthz.core.clock import ManualClock
from extauthz.envoy.headers import SHED_STATUS
from extauthz.proto import auth_pb2, auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.grpc_h2 import GrpcH2Server

from ..conftest import GRPC_SERVERS
from .test_http_server import POLICY_HEAD

POLICY = POLICY_HEAD + """\
  - {name: rate, type: request_rate, rate: 1, burst: 2, applies_to: {path_prefix: /rate}}
  - {name: closed-rate, type: request_rate, rate: 1, burst: 1, failure_mode: closed,
     applies_to: {path_prefix: /closed}}
  - {name: shadow-rate, type: request_rate, rate: 1, burst: 1, mode: shadow,
     applies_to: {path_prefix: /shadow}}
  - {name: cc, type: concurrent_requests, limit: 1, applies_to: {path_prefix: /cc}}
  - {name: fleet, type: fleet_usage, capacity: 2, reserved_for_critical: 0.5,
     applies_to: {path_prefix: /fleet}}
  - name: workers
    type: worker_utilization
    signal: {source: inflight, capacity: 100}
    applies_to: {path_prefix: /shed}
  - {name: per-ip, type: request_rate, rate: 0.001, burst: 2, key: [{source_ip: true}],
     applies_to: {path_prefix: /ip}}
  - {name: per-method, type: request_rate, rate: 0.001, burst: 1, key: [{identity: true}, {method: true}],
     applies_to: {path_prefix: /method}}
  - {name: per-key, type: request_rate, rate: 0.001, burst: 1, key: [{header: x-api-key}],
     applies_to: {path_prefix: /keyed}}
  - {name: monthly, type: quota, limit: 2, period: month, applies_to: {path_prefix: /quota}}
"""

# (method, path, api key, expected client status): every limiter kind, allowed and refused
TABLE = [
    ("GET", "/rate/a", "sk_live_u1", 200),
    ("GET", "/rate/a", "sk_live_u1", 200),
    ("GET", "/rate/a", "sk_live_u1", 429),       # request_rate: refused
    ("GET", "/rate/a", "sk_test_u2", 200),       # test tier
    ("POST", "/v1/charges", "sk_live_u1", 200),  # rules: critical, no limiter
    ("GET", "/shadow/a", "sk_live_u3", 200),
    ("GET", "/shadow/a", "sk_live_u3", 200),     # shadow: would deny, allowed
    ("GET", "/cc/a", "sk_live_u4", 200),         # concurrent_requests: holds its lease
    ("GET", "/cc/a", "sk_live_u4", 429),         # refused while the first is in flight
    ("GET", "/cc/a", "sk_live_u5", 200),         # another user
    ("GET", "/fleet/a", "sk_live_u6", 200),      # fleet: 1 non-critical slot
    ("GET", "/fleet/a", "sk_live_u7", 503),      # fleet: refused (shedder)
    ("GET", "/shed/a", "sk_live_u8", 503),       # worker_utilization at full level: shed
    ("POST", "/v1/charges", "", 200),            # no identity: source ip
    ("GET", "/ip/a", "sk_live_k1", 200),         # key: [source_ip], whatever the API key
    ("GET", "/ip/a", "sk_live_k2", 200),
    ("GET", "/ip/a", "sk_live_k3", 429),
    ("GET", "/method/a", "sk_live_m1", 200),     # key: [identity, method]
    ("GET", "/method/a", "sk_live_m1", 429),
    ("POST", "/method/a", "sk_live_m1", 200),    # another method, another bucket
    ("GET", "/keyed/a", "", 200),                # no x-api-key: the limiter is skipped
    ("GET", "/keyed/a", "", 200),
    ("GET", "/keyed/a", "sk_live_h1", 200),
    ("GET", "/keyed/a", "sk_live_h1", 429),
    ("GET", "/quota/a", "sk_live_q1", 200),      # quota: 2 a month
    ("GET", "/quota/a", "sk_live_q1", 200),
    ("GET", "/quota/a", "sk_live_q1", 429),      # Retry-After: the month's end
]


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[tuple[Server, ...]]:
    """One server per gRPC server kind (GRPC_SERVERS: the asyncio one, then grpcio) and one
    for the HTTP port, last."""
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    clock = ManualClock()
    made = []
    try:
        for kind, http in [*((kind, None) for kind in GRPC_SERVERS), ("asyncio", "127.0.0.1:0")]:
            srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", http_listen=http,
                                      grpc_server=kind, admin_listen="off", reload_interval=0,
                                      identity_salt="s"), clock=clock)
            await srv.start()
            made.append(srv)
        yield tuple(made)
    finally:
        for srv in made:
            await srv.stop(grace=0)


Answer = tuple[int, dict[str, str], str]


def grpc_answer(resp: auth_pb2.CheckResponse) -> Answer:
    if resp.WhichOneof("http_response") == "denied_response":
        d = resp.denied_response
        return d.status.code, {h.header.key: h.header.value for h in d.headers}, d.body
    ok = resp.ok_response
    headers = {h.header.key: h.header.value for h in [*ok.headers, *ok.response_headers_to_add]}
    headers |= {k: v.string_value for k, v in resp.dynamic_metadata.fields.items()}
    return 200, headers, ""


async def http_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str,
                      key: str) -> Answer:
    head = f"{method} {path} HTTP/1.1\r\nhost: api.example.com\r\nx-request-id: rid\r\n" \
           f"x-forwarded-for: 10.9.9.9, 10.1.2.3\r\ncontent-length: 0\r\n"
    if key:
        head += f"x-api-key: {key}\r\n"
    writer.write((head + "\r\n").encode())
    lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = (await reader.readexactly(int(headers.pop("content-length")))).decode()
    return (503 if status == SHED_STATUS else status), headers, body


def check_request(method: str, path: str, key: str) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = method, path, "api.example.com"
    http.headers["x-request-id"] = "rid"
    if key:
        http.headers["x-api-key"] = key
    req.attributes.source.address.socket_address.address = "10.1.2.3"
    return req


def masked(answer: Answer) -> Answer:
    status, headers, body = answer
    for random_field in ("x-extauthz-lease-id", "x-extauthz-lease-ticket"):  # random id, per-process key
        if random_field in headers:
            headers = {**headers, random_field: "<present>"}
    return status, headers, body


async def test_same_decisions_and_headers_over_both_protocols(servers: tuple[Server, ...]) -> None:
    """Every gRPC server kind and the HTTP port, step by step: the same answers."""
    *grpc_servers, http_server = servers
    assert [isinstance(srv.grpc, GrpcH2Server) for srv in grpc_servers] == [True, False]  # both kinds
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") for srv in grpc_servers]
    stubs = [auth_pb2_grpc.AuthorizationStub(channel) for channel in channels]
    reader, writer = await asyncio.open_connection("127.0.0.1", http_server.http_port)
    try:
        seen = []
        for method, path, key, expected in TABLE:
            for srv in servers:  # (the sampler, every 8 s, would lower it again)
                for shedder in srv.engine.snapshot.workers:
                    shedder.set_level(1.0)  # shed every non-critical tier
            over_grpc = [grpc_answer(await stub.Check(check_request(method, path, key))) for stub in stubs]
            over_http = await http_answer(reader, writer, method, path, key)
            step = (method, path, key)
            for kind, answer in zip(GRPC_SERVERS, over_grpc, strict=True):
                assert masked(over_http) == masked(answer), (kind, step)
            assert over_http[0] == expected, (step, over_http)
            seen.append(over_http)
    finally:
        writer.close()
        for channel in channels:
            await channel.close()
    # the table exercised what it claims: leases, RateLimit headers, problem+json
    assert any("x-extauthz-leases" in h and "x-extauthz-lease-ticket" in h for _, h, _ in seen)
    assert any("ratelimit" in h for s, h, _ in seen if s == 200)
    assert all(h.get("content-type") == "application/problem+json" and b for s, h, b in seen if s != 200)
    assert {s for s, _, _ in seen} == {200, 429, 503}
    assert any('"monthly";q=2;w=' in h.get("ratelimit-policy", "") and "reset" in b
               for s, h, b in seen if s == 429)
