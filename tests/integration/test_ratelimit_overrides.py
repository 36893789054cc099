"""ShouldRateLimit: a descriptor's own ``limit`` (Envoy's per-descriptor override) applied to
a quota of its unit and ignored (counted) otherwise; ``detailed_metric`` counted per
descriptor value under a bounded label that never holds the raw value. Both gRPC servers,
one frozen clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from extauthz.core.clock import ManualClock
from extauthz.proto import ratelimit_common_pb2, rls_pb2, rls_pb2_grpc
from extauthz.server import rls
from extauthz.server.app import Server, ServerConfig

POLICY = """\
version: 1
limiters:
  - name: per-key
    type: quota
    limit: 5
    period: minute
    match: {domain: edge, descriptor: [{key: api_key}]}
    detailed_metric: true
  - name: per-ip
    type: request_rate
    rate: 10
    burst: 2
    match: {domain: edge, descriptor: [{key: remote_address}]}
"""
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
Unit = rls_pb2.RateLimitResponse.RateLimit


@pytest.fixture(params=["grpcio", "asyncio"])
async def server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=request.param),
                 clock=ManualClock(1_800_000_000.5))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=0)


def ask(key: str, value: str, limit: tuple[int, int] | None = None) -> rls_pb2.RateLimitRequest:
    d = ratelimit_common_pb2.RateLimitDescriptor(entries=[ratelimit_common_pb2.RateLimitDescriptor.Entry(
        key=key, value=value)])
    if limit is not None:
        d.limit.requests_per_unit, d.limit.unit = limit
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[d])


async def codes(stub: rls_pb2_grpc.RateLimitServiceStub, n: int, request: rls_pb2.RateLimitRequest) -> list[int]:
    return [(await stub.ShouldRateLimit(request)).overall_code for _ in range(n)]


async def test_a_descriptors_limit_applies_to_a_quota_of_its_unit_else_it_is_ignored(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        # 2 a minute instead of the policy's 5: the count is the same descriptor's
        answer = await stub.ShouldRateLimit(ask("api_key", "k1", (2, Unit.MINUTE)))
        assert answer.statuses[0].current_limit.requests_per_unit == 2
        assert answer.statuses[0].limit_remaining == 1
        assert await codes(stub, 2, ask("api_key", "k1", (2, Unit.MINUTE))) == [OK, OVER]
        # without its limit the policy's 5 decides the same count (2 taken)
        assert await codes(stub, 4, ask("api_key", "k1")) == [OK, OK, OK, OVER]
        # another unit than the quota's period: ignored, the policy decides
        answer = await stub.ShouldRateLimit(ask("api_key", "k2", (1, Unit.HOUR)))
        assert answer.statuses[0].current_limit.requests_per_unit == 5
        assert await codes(stub, 4, ask("api_key", "k2", (1, Unit.HOUR))) == [OK] * 4
        # a token bucket: ignored
        assert await codes(stub, 3, ask("remote_address", "10.0.0.1", (100, Unit.SECOND))) == [OK, OK, OVER]
        # zero: every request over it, as the peer's
        assert await codes(stub, 1, ask("api_key", "k3", (0, Unit.MINUTE))) == [OVER]
        door = server.ratelimit.door
        assert door.overrides == {"applied": 4, "ignored": 8}


async def test_detailed_metric_counts_per_value_under_a_bounded_label(server: Server,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rls, "MAX_DETAILED_VALUES", 2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        for key, n in (("sk_live_alice", 6), ("sk_live_bob", 1), ("sk_live_carol", 1), ("sk_live_dave", 1)):
            await codes(stub, n, ask("api_key", key))
        await codes(stub, 1, ask("remote_address", "10.0.0.1"))  # not detailed
    detailed = server.ratelimit.door.detailed
    labels = {value for _, value, _ in detailed}
    assert len(labels) == 3 and "other" in labels  # two values, then the rest together
    assert all("sk_live" not in value for value in labels)  # never the raw value
    assert {name for name, _, _ in detailed} == {"per-key"}
    by_code: dict[str, int] = {}
    for (_, _value, code), n in detailed.items():
        by_code[code] = by_code.get(code, 0) + n
    assert by_code == {"ok": 8, "over_limit": 1}
    assert sum(n for (_, value, _), n in detailed.items() if value == "other") == 2
    status = server.panel.status()["ratelimit_detailed"]["per-key"]
    assert status["other"] == {"ok": 2}
    (family,) = [m for m in server.panel.collect() if m.name == "extauthz_ratelimit_detailed"]
    assert {s.labels["value"] for s in family.samples} == labels
