"""ShouldRateLimit (envoy.service.ratelimit.v3.RateLimitService) on the gRPC port, on both
gRPC servers: the policy's limiters with ``match`` decide each descriptor, on the same
engine and store as Check (one frozen clock; fixed windows aligned to the unit)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import wrappers_pb2

from extauthz.core.clock import ManualClock
from extauthz.proto import auth_pb2, auth_pb2_grpc, ratelimit_common_pb2, rls_pb2, rls_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.rls import MAX_DESCRIPTORS
from testinfra.redis_servers import RedisSingle

POLICY = """\
version: 1
identity: [{header: x-api-key}]
limiters:
  - name: per-ip
    type: quota
    limit: 2
    period: second
    match: {domain: edge, descriptor: [{key: remote_address}]}
  - name: per-ip-path
    type: quota
    limit: 5
    period: minute
    match: {domain: edge, descriptor: [{key: remote_address}, {key: path, value: /search}]}
    replaces: [per-ip]
  - name: shadow-key
    type: quota
    limit: 1
    period: hour
    mode: shadow
    match: {domain: edge, descriptor: [{key: api_key}]}
  - name: per-key-rate
    type: request_rate
    rate: 1
    burst: 3
    match: {domain: api, descriptor: [{key: plan, value: free}, {key: api_key}]}
    key: [{descriptor: api_key}]
  - {name: checked, type: request_rate, rate: 1, burst: 1}
unlimited:
  - match: {domain: edge, descriptor: [{key: remote_address, value: 10.0.0.1}]}
"""
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
Entries = list[tuple[str, str]]


@pytest.fixture(params=["grpcio", "asyncio"])
async def stub(request: pytest.FixtureRequest, tmp_path: Path
               ) -> AsyncIterator[tuple[rls_pb2_grpc.RateLimitServiceStub, grpc.aio.Channel, ManualClock, Server]]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    clock = ManualClock(1_800_000_000.5)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=request.param), clock=clock)
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        yield rls_pb2_grpc.RateLimitServiceStub(channel), channel, clock, srv
    finally:
        # the server first: a client closing just before the asyncio server's stop made its
        # close's write_eof raise ENOTCONN (grpc_h2.py; reported, not this test's subject)
        await srv.stop(grace=0)
        await channel.close()


def ask(domain: str, *descriptors: Entries, hits: int = 0, each: list[int | None] | None = None
        ) -> rls_pb2.RateLimitRequest:
    out = []
    for i, entries in enumerate(descriptors):
        d = ratelimit_common_pb2.RateLimitDescriptor(
            entries=[ratelimit_common_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
        if each is not None and each[i] is not None:
            d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=each[i]))
        out.append(d)
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=out, hits_addend=hits)


def codes(resp: rls_pb2.RateLimitResponse) -> tuple[int, list[int]]:
    return resp.overall_code, [s.code for s in resp.statuses]


async def test_descriptors_decided_per_value_in_windows_aligned_to_the_unit(stub) -> None:
    rls, _, clock, _ = stub
    ip = [("remote_address", "10.0.0.7")]
    answers = [await rls.ShouldRateLimit(ask("edge", ip), timeout=5) for _ in range(3)]
    assert [codes(a) for a in answers] == [(OK, [OK]), (OK, [OK]), (OVER, [OVER])]
    first = answers[0].statuses[0]
    assert (first.current_limit.requests_per_unit, first.current_limit.unit, first.current_limit.name) == (
        2, rls_pb2.RateLimitResponse.RateLimit.SECOND, "per-ip")
    assert [a.statuses[0].limit_remaining for a in answers] == [1, 0, 0]
    assert 0 < first.duration_until_reset.ToNanoseconds() <= 500_000_000  # the second's end
    headers = {h.key: h.value for h in answers[2].response_headers_to_add}
    assert headers["retry-after"] == "1" and headers["ratelimit"].startswith('"per-ip";r=0')
    other = await rls.ShouldRateLimit(ask("edge", [("remote_address", "10.0.0.8")]), timeout=5)
    assert codes(other) == (OK, [OK])  # the counter is per descriptor value
    clock.advance(0.5)  # the next second: a new window
    assert codes(await rls.ShouldRateLimit(ask("edge", ip), timeout=5)) == (OK, [OK])


async def test_replaces_unlimited_unknown_and_domain_mismatch(stub) -> None:
    rls, _, _, srv = stub
    ip, search = [("remote_address", "10.0.0.7")], [("remote_address", "10.0.0.7"), ("path", "/search")]
    # per-ip-path replaces per-ip: the per-ip descriptor is not counted (3 pass where 2 would)
    for _ in range(3):
        resp = await rls.ShouldRateLimit(ask("edge", ip, search), timeout=5)
        assert codes(resp) == (OK, [OK, OK])
        assert not resp.statuses[0].HasField("current_limit")
    assert codes(await rls.ShouldRateLimit(ask("edge", ip), timeout=5)) == (OK, [OK])  # per-ip: first use
    unlimited = await rls.ShouldRateLimit(ask("edge", *[[("remote_address", "10.0.0.1")]] * 5), timeout=5)
    assert codes(unlimited) == (OK, [OK] * 5) and unlimited.statuses[0].limit_remaining == 2**32 - 1
    door = srv.ratelimit.door if srv.ratelimit is not None else None
    assert door is not None
    assert door.unknown == 0
    before = door.unknown
    unknown = await rls.ShouldRateLimit(ask("edge", [("user_agent", "x")], [("remote_address", "1"), ("a", "b")]),
                                        timeout=5)
    mismatch = await rls.ShouldRateLimit(ask("other", ip), timeout=5)
    assert codes(unknown) == (OK, [OK, OK]) and codes(mismatch) == (OK, [OK])
    assert door.unknown == before + 3
    assert srv.panel.status()["ratelimit_descriptors"] == door.counts() == {
        "decided": 4, "refused": 0, "replaced": 3, "unknown": 3, "unlimited": 5}


async def test_shadow_mode_never_answers_over_limit(stub) -> None:
    rls, _, _, srv = stub
    key = [("api_key", "k1")]
    assert [codes(await rls.ShouldRateLimit(ask("edge", key), timeout=5)) for _ in range(3)] == [(OK, [OK])] * 3
    assert srv.ratelimit is not None and srv.ratelimit.door.decided == 3  # decided, not skipped
    # (counted as would-refuse: tests/unit/test_descriptors.py)


async def test_hits_addend_of_the_request_and_of_a_descriptor(stub) -> None:
    rls, _, _, _ = stub
    free = [("plan", "free"), ("api_key", "k1")]
    assert codes(await rls.ShouldRateLimit(ask("api", free, hits=2), timeout=5)) == (OK, [OK])  # 3 - 2
    # a descriptor's own hits_addend wins over the request's
    assert codes(await rls.ShouldRateLimit(ask("api", free, hits=5, each=[1]), timeout=5)) == (OK, [OK])
    assert codes(await rls.ShouldRateLimit(ask("api", free), timeout=5)) == (OVER, [OVER])
    other = [("plan", "free"), ("api_key", "k2")]
    assert codes(await rls.ShouldRateLimit(ask("api", other, hits=4), timeout=5)) == (OVER, [OVER])  # > burst
    assert codes(await rls.ShouldRateLimit(ask("api", [("plan", "pro"), ("api_key", "k1")]), timeout=5)) == (
        OK, [OK])  # no limiter for the pro plan


async def test_check_and_should_rate_limit_share_one_server_but_not_their_limiters(stub) -> None:
    rls, channel, _, _ = stub
    check = auth_pb2_grpc.AuthorizationStub(channel)
    req = auth_pb2.CheckRequest()
    req.attributes.request.http.method = "GET"
    req.attributes.request.http.path = "/x"
    req.attributes.request.http.headers["x-api-key"] = "u1"
    # the checked limiter (burst 1) is not touched by descriptors, the descriptor limiters not by Check
    for _ in range(3):
        await rls.ShouldRateLimit(ask("edge", [("remote_address", "10.0.0.9")]), timeout=5)
    assert (await check.Check(req, timeout=5)).status.code == 0
    assert (await check.Check(req, timeout=5)).status.code != 0


async def test_a_request_without_a_domain_or_with_too_many_descriptors_is_refused(stub) -> None:
    rls, _, _, srv = stub
    ip = [("remote_address", "10.0.0.7")]
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await rls.ShouldRateLimit(ask("", ip), timeout=5)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "domain must not be empty" in (empty.value.details() or "")
    many = [[("remote_address", f"10.1.{i // 256}.{i % 256}")] for i in range(MAX_DESCRIPTORS + 1)]
    with pytest.raises(grpc.aio.AioRpcError) as flood:
        await rls.ShouldRateLimit(ask("edge", *many), timeout=5)
    assert flood.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_DESCRIPTORS}" in (flood.value.details() or "")
    door = srv.ratelimit.door if srv.ratelimit is not None else None
    assert door is not None and door.decided == 0 and door.refused == 1 + MAX_DESCRIPTORS + 1
    # as many as allowed are all decided
    resp = await rls.ShouldRateLimit(ask("edge", *many[:MAX_DESCRIPTORS]), timeout=5)
    assert codes(resp) == (OK, [OK] * MAX_DESCRIPTORS) and door.decided == MAX_DESCRIPTORS


async def test_a_descriptors_hits_addend_of_zero_checks_without_counting(stub) -> None:
    # envoyproxy/ratelimit (utils.GetHitsAddends): a descriptor's own hits_addend may be 0,
    # "check only"; the request's 0 is the default (one hit, here the limiter's cost)
    rls, _, _, _ = stub
    ip = [("remote_address", "10.0.0.5")]
    peeks = [await rls.ShouldRateLimit(ask("edge", ip, each=[0]), timeout=5) for _ in range(3)]
    assert [codes(p) for p in peeks] == [(OK, [OK])] * 3
    assert [p.statuses[0].limit_remaining for p in peeks] == [2, 2, 2]
    counted = [await rls.ShouldRateLimit(ask("edge", ip, hits=0), timeout=5) for _ in range(2)]
    assert [c.statuses[0].limit_remaining for c in counted] == [1, 0]
    full = await rls.ShouldRateLimit(ask("edge", ip, each=[0]), timeout=5)
    assert codes(full) == (OK, [OK]) and full.statuses[0].limit_remaining == 0  # at the limit, not over
    assert codes(await rls.ShouldRateLimit(ask("edge", ip), timeout=5)) == (OVER, [OVER])


async def test_hits_over_the_limit_are_not_counted(stub) -> None:
    # where extauthz decides differently (docs/migrating.md): the peer adds a refused
    # request's hits to its counter too, so a smaller request after it is refused as well
    rls, _, _, _ = stub
    ip = [("remote_address", "10.0.0.6")]
    big = await rls.ShouldRateLimit(ask("edge", ip, hits=5), timeout=5)
    assert codes(big) == (OVER, [OVER]) and big.statuses[0].limit_remaining == 2
    small = [await rls.ShouldRateLimit(ask("edge", ip), timeout=5) for _ in range(3)]
    assert [codes(s) for s in small] == [(OK, [OK]), (OK, [OK]), (OVER, [OVER])]


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_each_decided_descriptor_is_counted_on_the_ratelimit_door(grpc_server: str, tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              metrics_listen="127.0.0.1:0", reload_interval=0, identity_salt="s",
                              grpc_server=grpc_server), clock=ManualClock(1_800_000_000.5))
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        rls = rls_pb2_grpc.RateLimitServiceStub(channel)
        ip = [("remote_address", "10.0.0.7")]
        for _ in range(3):  # 2 allowed, 1 over; the unknown descriptor is not decided
            await rls.ShouldRateLimit(ask("edge", ip, [("user_agent", "x")]), timeout=5)
        metrics = srv.observe.metrics
        assert metrics is not None

        def count(door: str, decision: str) -> float | None:
            return metrics.registry.get_sample_value("extauthz_check_duration_seconds_count",
                                                     {"door": door, "decision": decision})

        assert (count("ratelimit", "allowed"), count("ratelimit", "rate_limited")) == (2, 1)
        assert count("grpc", "allowed") == 0
    finally:
        await srv.stop(grace=0)
        await channel.close()


@pytest.mark.redis
@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_a_stalled_redis_fails_every_descriptor_open_within_the_calls_deadline(
        grpc_server: str, tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=grpc_server,
                              redis_url=redis_single_clean.url, check_budget_ms=100))
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        rls = rls_pb2_grpc.RateLimitServiceStub(channel)
        many = [[("remote_address", f"10.2.0.{i}")] for i in range(8)]
        assert codes(await rls.ShouldRateLimit(ask("edge", *many), timeout=5)) == (OK, [OK] * 8)
        redis_single_clean.pause()
        try:
            # each descriptor waits at most what the call has left: eight stalled store calls
            # of the whole budget each would outlive the 300 ms the filter gives
            resp = await rls.ShouldRateLimit(ask("edge", *many), timeout=0.3)
        finally:
            redis_single_clean.resume()
        assert codes(resp) == (OK, [OK] * 8)  # failed open (failure_mode: open)
    finally:
        await srv.stop(grace=0)
        await channel.close()
