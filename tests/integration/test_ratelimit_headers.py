"""ShouldRateLimit's rate limit headers as the policy's ``ratelimit_headers`` asks for them:
``counts`` (envoyproxy/ratelimit's ``LIMIT_RESPONSE_HEADERS_ENABLED``: the limit, what is
left and the seconds until the window ends, of the descriptor over its limit, else of the one
with the least left, under the names chosen), ``none``, and ``ietf`` (the default, asserted
in test_ratelimit_service.py). Both gRPC servers, one frozen clock."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from extauthz.core.clock import ManualClock
from extauthz.devtools.stack import free_port
from extauthz.proto import ratelimit_common_pb2, rls_pb2, rls_pb2_grpc
from extauthz.server.app import Server, ServerConfig

LIMITERS = """\
limiters:
  - name: per-ip
    type: quota
    limit: 2
    period: minute
    match: {domain: edge, descriptor: [{key: remote_address}]}
  - name: per-key
    type: request_rate
    rate: 1
    burst: 3
    match: {domain: edge, descriptor: [{key: api_key}]}
unlimited:
  - match: {domain: edge, descriptor: [{key: remote_address, value: 10.0.0.1}]}
"""
COUNTS = """\
version: 1
ratelimit_headers:
  style: counts
  names: {limit: X-RateLimit-Limit, remaining: X-RateLimit-Remaining, reset: X-RateLimit-Reset}
"""
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
#: half a second into a minute (1_800_000_000 is a whole minute)
START = 1_800_000_000.5


@contextlib.asynccontextmanager
async def served(policy_text: str, grpc_server: str, tmp_path: Path, clock: ManualClock,
                 redis_url: str | None = None, limiters: str = LIMITERS
                 ) -> AsyncIterator[rls_pb2_grpc.RateLimitServiceStub]:
    policy = tmp_path / "p.yaml"
    policy.write_text(policy_text + limiters)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=grpc_server,
                              redis_url=redis_url), clock=clock)
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        yield rls_pb2_grpc.RateLimitServiceStub(channel)
    finally:
        await srv.stop(grace=0)
        await channel.close()


def ask(*descriptors: tuple[str, str]) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[
        ratelimit_common_pb2.RateLimitDescriptor(entries=[ratelimit_common_pb2.RateLimitDescriptor.Entry(
            key=k, value=v)]) for k, v in descriptors])


def headers(resp: rls_pb2.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in resp.response_headers_to_add}


def counts(limit: int, remaining: int, reset: int) -> dict[str, str]:
    return {"x-ratelimit-limit": str(limit), "x-ratelimit-remaining": str(remaining),
            "x-ratelimit-reset": str(reset)}


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_counts_of_the_descriptor_closest_to_its_limit(grpc_server: str, tmp_path: Path) -> None:
    clock = ManualClock(START)
    async with served(COUNTS, grpc_server, tmp_path, clock) as rls:
        ip, key = ("remote_address", "10.0.0.7"), ("api_key", "k1")
        assert headers(await rls.ShouldRateLimit(ask(ip), timeout=5)) == counts(2, 1, 60)
        clock.advance(10)  # 49.5 s left of the minute: rounded up
        # the bucket (1 a second, 2 of its 3 left) has more left than the quota (0 of 2)
        assert headers(await rls.ShouldRateLimit(ask(key, ip), timeout=5)) == counts(2, 0, 50)
        # the bucket alone: its rate in the first unit that holds one request, and the time
        # until it is full again (2 s: two tokens at 1 a second)
        assert headers(await rls.ShouldRateLimit(ask(key), timeout=5)) == counts(1, 1, 2)
        # the bucket's last token (0 left, allowed) beside the quota over its limit: the one over
        over = await rls.ShouldRateLimit(ask(key, ip), timeout=5)
        assert [s.limit_remaining for s in over.statuses] == [0, 0]
        assert over.overall_code == OVER and headers(over) == counts(2, 0, 50)
        # the bucket over its limit: its reset is when it admits again (a token in 1 s)
        assert headers(await rls.ShouldRateLimit(ask(key), timeout=5)) == counts(1, 0, 1)
        # no descriptor with a limit (unlimited, unknown): no headers, as the peer's
        assert headers(await rls.ShouldRateLimit(ask(("remote_address", "10.0.0.1"), ("user", "u")),
                                                 timeout=5)) == {}


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_none_adds_no_headers(grpc_server: str, tmp_path: Path) -> None:
    async with served("version: 1\nratelimit_headers: {style: none}\n", grpc_server, tmp_path,
                      ManualClock(START)) as rls:
        ip = ("remote_address", "10.0.0.7")
        answers = [await rls.ShouldRateLimit(ask(ip), timeout=5) for _ in range(3)]
        assert [a.overall_code for a in answers][-1] == OVER
        assert [headers(a) for a in answers] == [{}, {}, {}]
        assert answers[0].statuses[0].current_limit.requests_per_unit == 2  # the statuses stay whole


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_counts_of_the_last_descriptor_over_its_limit(grpc_server: str, tmp_path: Path) -> None:
    """Two descriptors over their limits: the peer's loop keeps the last one over (each over
    one replaces the one kept), so the headers follow the order Envoy sends them in."""
    async with served(COUNTS, grpc_server, tmp_path, ManualClock(START)) as rls:
        ip, key = ("remote_address", "10.0.0.7"), ("api_key", "k1")
        for _ in range(2):
            await rls.ShouldRateLimit(ask(ip), timeout=5)
        for _ in range(3):
            await rls.ShouldRateLimit(ask(key), timeout=5)
        both = await rls.ShouldRateLimit(ask(ip, key), timeout=5)
        assert [s.code for s in both.statuses] == [OVER, OVER]
        assert headers(both) == counts(1, 0, 1)  # the bucket's: a token in 1 s
        both = await rls.ShouldRateLimit(ask(key, ip), timeout=5)
        assert [s.code for s in both.statuses] == [OVER, OVER]
        assert headers(both) == counts(2, 0, 60)  # the quota's: its minute ends in 59.5 s


@pytest.mark.parametrize("style", [COUNTS, "version: 1\n"], ids=["counts", "ietf"])
async def test_a_store_that_fails_tells_no_limit(style: str, tmp_path: Path) -> None:
    """A Redis that refuses connections: each descriptor fails open (OK) with no count, so
    its status carries no ``current_limit`` (a limit beside ``limit_remaining`` 0 told the
    client it was out: the counts headers, and Envoy's own x-ratelimit headers read the
    statuses) and no headers name a limit; envoyproxy/ratelimit fails the call then."""
    async with served(style, "asyncio", tmp_path, ManualClock(START),
                      redis_url=f"redis://127.0.0.1:{free_port()}") as rls:
        resp = await rls.ShouldRateLimit(ask(("api_key", "k1"), ("remote_address", "10.0.0.7")), timeout=5)
        assert resp.overall_code == rls_pb2.RateLimitResponse.OK
        assert [s.HasField("current_limit") for s in resp.statuses] == [False, False]
        assert headers(resp) == {}


async def test_no_counts_when_what_refuses_has_no_count(tmp_path: Path) -> None:
    """A concurrent_requests descriptor over its limit beside a bucket that allows: the answer
    refuses, and the bucket's figures (1 left) would tell the client to go on; the peer's
    headers on a refusal are always of a descriptor over its limit."""
    in_flight = LIMITERS.replace("unlimited:", """\
  - name: in-flight
    type: concurrent_requests
    limit: 1
    match: {domain: edge, descriptor: [{key: conn}]}
unlimited:""")
    async with served(COUNTS, "asyncio", tmp_path, ManualClock(START), limiters=in_flight) as rls:
        conn, key = ("conn", "c1"), ("api_key", "k1")
        first = await rls.ShouldRateLimit(ask(conn, key), timeout=5)
        assert first.overall_code == rls_pb2.RateLimitResponse.OK and headers(first) == counts(1, 2, 1)
        second = await rls.ShouldRateLimit(ask(conn, key), timeout=5)  # the first still in flight
        assert [s.code for s in second.statuses] == [OVER, rls_pb2.RateLimitResponse.OK]
        assert second.statuses[1].limit_remaining == 1 and headers(second) == {}
