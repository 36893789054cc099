"""A lost Redis connection on the lean path (store/redis/conn.py): no check waits for a
reconnect, reconnects are few (one attempt at a time, with backoff), and the store comes
back by itself once Redis does.

The regression this guards: with Redis killed, every check opened a connection of its own
(~900 us of client CPU per failing check), which saturated the server until the breaker opened.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from extauthz.core.clock import SYSTEM_CLOCK
from extauthz.core.context import RawRequest
from extauthz.engine.breaker import Breaker
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import Policy, load_policy
from extauthz.store.redis import RedisStore
from extauthz.store.redis.conn import RECONNECT_BACKOFF_CAP
from testinfra.redis_servers import RedisSingle
from tests.store.redis.helpers import wait_until

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 1000
    burst: 100000
  - name: user-concurrency
    type: concurrent_requests
    limit: 1000
"""

#: Client socket timeouts: a connect attempt to a stopped Redis (the kernel accepts the TCP
#: connection, nobody answers the handshake) hangs this long.
CLIENT_TIMEOUT = 3.0
#: The engine's deadline here: far below CLIENT_TIMEOUT (a check that waited for a connect
#: would be cut by it and counted as ``timeout``), far above a noisy machine's stalls.
DEADLINE = 0.5


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return load_policy([path])


async def run_checks(engine: Engine, seconds: float, tasks: int = 3) -> list[tuple[bool, tuple[str, ...]]]:
    """Checks from ``tasks`` concurrent callers for ``seconds``: (allowed, failure reasons)."""
    out: list[tuple[bool, tuple[str, ...]]] = []
    stop = time.monotonic() + seconds

    async def one(t: int) -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            raw = RawRequest("GET", "/v1/things", headers={"x-api-key": f"user{t}-{i % 20}"})
            _, decision = await engine.check(raw)
            out.append((decision.allowed, decision.failures))
            await asyncio.sleep(0.002)

    await asyncio.gather(*(one(t) for t in range(tasks)))
    return out


def store_and_engine(redis: RedisSingle, policy: Policy,
                     breaker: Breaker | None = None) -> tuple[RedisStore, Engine]:
    """A store with CLIENT_TIMEOUT sockets and an engine at DEADLINE; by default a breaker
    that never opens, so every check reaches the store."""
    store = RedisStore.from_url(redis.url, deadline=DEADLINE,
                                socket_timeout=CLIENT_TIMEOUT, socket_connect_timeout=CLIENT_TIMEOUT)
    return store, Engine(StoreGate(store, DEADLINE, breaker=breaker or Breaker(SYSTEM_CLOCK, threshold=10**9)), policy)


def new_failures(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in engine.failures.items() if v - before.get(k, 0)}


@pytest.mark.redis
async def test_killed_or_unanswering_redis_fails_open_without_waiting_for_connects(
    redis_single_clean: RedisSingle, policy: Policy
) -> None:
    # No breaker (it never opens): every check reaches the store, which is what could storm.
    store, engine = store_and_engine(redis_single_clean, policy)

    async def recovered() -> bool:
        _, decision = await engine.check(RawRequest("GET", "/", headers={"x-api-key": "probe"}))
        return decision.allowed and not decision.failures

    try:
        await wait_until(recovered, 5, "a first store-backed check")
        node = store._nodes[""]
        assert (node.connects, node.attempts) == (1, 1)

        # 1. Redis killed: connects are refused at once. Every check fails open as
        # ``unavailable`` (none waits for its deadline), and the connect attempts follow the
        # backoff (2.5 ms doubling: at most ~10 in 0.8 s), not the checks (hundreds).
        before = dict(engine.failures)
        redis_single_clean.kill()
        down = await run_checks(engine, 0.8)
        assert down and all(allowed for allowed, _ in down)  # every check answered
        assert all(failures == ("unavailable",) for _, failures in down[5:]), set(down)
        assert set(new_failures(engine, before)) == {"unavailable"}, new_failures(engine, before)
        assert len(down) >= 50
        assert 1 <= node.attempts - 1 <= 12, (node.attempts, len(down))

        redis_single_clean.restart()
        await wait_until(recovered, 5, "recovery after Redis came back")
        assert node.connects == 2

        # 2. The connection lost while Redis cannot answer (stopped: the kernel still
        # accepts connections, the handshake hangs for CLIENT_TIMEOUT): the reconnect hangs
        # in the background while every check fails open at once, never as ``timeout``.
        attempts = node.attempts
        with redis_single_clean.client() as admin:
            admin.client_kill_filter(_type="normal", skipme=True)
        redis_single_clean.pause()
        try:
            await asyncio.sleep(0.05)  # the loss is seen: it starts the reconnect attempt
            before = dict(engine.failures)
            hung = await run_checks(engine, 0.8)
            assert hung and all(allowed for allowed, _ in hung)
            assert set(new_failures(engine, before)) == {"unavailable"}, new_failures(engine, before)
            assert node.attempts == attempts + 1  # one attempt (started by the loss), still waiting
        finally:
            redis_single_clean.resume()
        await wait_until(recovered, 5, "recovery after Redis answered again")
        assert node.connects == 3
    finally:
        redis_single_clean.resume()
        await store.close()


@pytest.mark.redis
async def test_the_first_check_after_an_outage_finds_the_connection_open(
    redis_single_clean: RedisSingle, policy: Policy
) -> None:
    """Reconnect attempts go on in the background until one opens, whether or not checks
    come: the breaker's first probe after an outage is served by Redis, not failed (which
    would keep the breaker open for another open_for)."""
    store, engine = store_and_engine(redis_single_clean, policy)
    probe = RawRequest("GET", "/", headers={"x-api-key": "probe"})
    try:
        _, decision = await engine.check(probe)
        assert decision.allowed and not decision.failures
        node = store._nodes[""]
        redis_single_clean.kill()
        _, decision = await engine.check(probe)   # sees the loss: the attempts start
        assert decision.failures == ("unavailable",)
        await asyncio.sleep(0.3)                  # attempts refused, backing off
        redis_single_clean.restart()
        await asyncio.sleep(2 * RECONNECT_BACKOFF_CAP)  # no check in the meantime
        assert node.connects == 2                 # opened by the background attempts
        _, decision = await engine.check(probe)
        assert decision.allowed and not decision.failures
    finally:
        await store.close()
    assert node._retry is None and node._closed


@pytest.mark.redis
async def test_a_demoted_master_is_left_for_a_new_connection(
    redis_single_clean: RedisSingle, policy: Policy
) -> None:
    """A node that turned read-only (a failover behind a DNS name or a VIP) answers a merged
    check.lua call with READONLY: the whole call fails, the connection is dropped and opened
    again (to whatever the address names now), with backoff, not kept for every check."""
    store, engine = store_and_engine(redis_single_clean, policy)
    probe = RawRequest("GET", "/", headers={"x-api-key": "probe"})
    try:
        _, decision = await engine.check(probe)
        assert decision.allowed and not decision.failures
        node = store._nodes[""]
        with redis_single_clean.client() as admin:
            admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # read-only, its master unreachable
        try:
            down = await run_checks(engine, 0.5, tasks=1)
            assert down and all(allowed for allowed, _ in down)       # failed open
            assert 2 <= node.connects <= 12, (node.connects, len(down))  # dropped, reopened, backing off
        finally:
            with redis_single_clean.client() as admin:
                admin.execute_command("REPLICAOF", "NO", "ONE")

        async def recovered() -> bool:
            _, decision = await engine.check(probe)
            return decision.allowed and not decision.failures

        await wait_until(recovered, 5, "store-backed checks on the writable node again")
    finally:
        await store.close()


@pytest.mark.redis
async def test_the_breaker_opens_on_refused_connects(redis_single_clean: RedisSingle,
                                                     policy: Policy) -> None:
    store, engine = store_and_engine(redis_single_clean, policy,
                                     Breaker(SYSTEM_CLOCK, threshold=5, open_for=0.2))

    async def recovered() -> bool:
        _, decision = await engine.check(RawRequest("GET", "/", headers={"x-api-key": "probe"}))
        return decision.allowed and not decision.failures

    try:
        await wait_until(recovered, 5, "a first store-backed check")
        before = dict(engine.failures)
        redis_single_clean.kill()
        down = await run_checks(engine, 0.6)
        assert all(allowed for allowed, _ in down)
        new = new_failures(engine, before)
        assert set(new) == {"unavailable", "circuit_open"}, new
        redis_single_clean.restart()
        await wait_until(recovered, 5, "recovery after Redis came back")
        assert engine.gate.breaker.state == "closed"
    finally:
        await store.close()
