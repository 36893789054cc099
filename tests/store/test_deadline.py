"""The store deadline measures the store, not the server's own busy event loop (issues 24, 29).

At saturation an answer from Redis waits a loop turn for each hop between the socket and the
check (read, the sender task, the store call, the shield), and a check's command may wait in
the batcher's queue before it is written: with long turns the deadline passed while Redis had
long answered (or had not been asked yet), the check failed open and the breaker opened on a
healthy store. Now the deadline counts from the check's own write, is checked after one I/O
poll (``Store.waiting``), each pass counted by where the check was
(``StoreGate.deadline_missed``: queued, redis, loop); only a store that is late fails the check
and counts on the breaker. A failed-open batched grant op gives back what it took.

Real Redis; the busy loop is a blocking sleep inside the store call, after the command was
written (or before), so that Redis answers while nothing reads the answer.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis

from extauthz.core.clock import SYSTEM_CLOCK, ManualClock
from extauthz.engine import storegate as gate_module
from extauthz.engine.breaker import Breaker
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.request_rate import RequestRateLimiter
from extauthz.store.base import CheckResult, Op
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store
from tests.store.redis.helpers import wait_until
from tests.unit.helpers import RATE, get, policy_from

pytestmark = pytest.mark.redis

DEADLINE = 0.01
#: how long the loop is kept busy after the write: many deadlines, far more than Redis
#: needs to answer on any machine
BUSY = 0.1


async def written(store: RedisStore) -> None:
    """Wait until a command is on the wire and waiting for its reply."""
    node = store._nodes[""]
    for _ in range(1000):
        if node.waiting_since is not None:
            return
        await asyncio.sleep(0)
    raise AssertionError("the check was never written to Redis")


def engine_on(store: RedisStore, tmp_path: Path, busy: bool, before_write: bool = False) -> Engine:
    """An engine whose store call, when ``busy``, blocks the loop once the command is
    written (``before_write``: once it is queued, before the batcher writes it, and again once
    written). The breaker
    never opens (each check reaches the store) but counts."""
    async def check(ops: Sequence[Op], lease_id: str) -> CheckResult:
        call = asyncio.ensure_future(store.check(ops, lease_id))
        if busy and before_write:
            await asyncio.sleep(0)  # the store call has queued its command, not written it
            assert store._nodes[""].waiting_since is None
            time.sleep(BUSY)  # noqa: ASYNC251 - the point: nothing runs, nothing is written
            # then busy again once it is written: Redis answers while nothing reads (a slow
            # machine's Redis gets a whole busy turn, not one deadline)
            await written(store)
            time.sleep(BUSY)  # noqa: ASYNC251
        elif busy:
            await written(store)
            time.sleep(BUSY)  # noqa: ASYNC251 - the point: nothing runs, nothing is read
        return await call

    return Engine(StoreGate(store, DEADLINE, breaker=Breaker(SYSTEM_CLOCK, threshold=1, ratio=0.0), store_check=check),
                  policy_from(tmp_path, {"limiters": [RATE]}))


@pytest.mark.parametrize("extensions", [gate_module.LOOP_EXTENSIONS, 0], ids=["shipped", "none"])
async def test_an_answer_the_busy_loop_has_not_read_is_no_timeout(
        redis_single_clean: RedisSingle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        extensions: int) -> None:
    monkeypatch.setattr(gate_module, "LOOP_EXTENSIONS", extensions)
    store = RedisStore.from_url(redis_single_clean.url, deadline=DEADLINE)
    try:
        await store.ping()
        engine = engine_on(store, tmp_path, busy=True)
        _, decision = await engine.check(get())
        # Redis answered during the busy turn: its reply was read at the poll after the deadline
        assert engine.gate.deadline_missed == {"queued": 0, "redis": 0, "loop": 1}
        if extensions:
            # Redis answered in time: the rate limiter decided, nothing failed open
            assert decision.allowed and decision.failures == ()
            assert decision.verdicts[0].reason != "store_timeout"
            assert engine.gate.deadline_extended == 1 and engine.failures == {}
        else:  # no extension: the deadline that passed in the busy loop fails it open...
            assert decision.failures == ("timeout",)
            assert engine.failures == {"timeout": 1}
        # ...but the store was not late: no breaker counts it (issue 29: it opened under load)
        assert engine.gate.breaker.failures == 0 and engine.gate.breaker.state == "closed"
    finally:
        await store.close()


@pytest.mark.parametrize("extensions", [gate_module.LOOP_EXTENSIONS, 0], ids=["shipped", "none"])
async def test_a_check_queued_past_its_deadline_is_not_the_stores_failure(
        redis_single_clean: RedisSingle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        extensions: int) -> None:
    """Issue 29: the deadline is measured from the write. A check whose command waited in
    this server (the batcher's queue, a long loop turn) past the deadline before it was even
    written is given the deadline from its write; and when no extension is left it fails
    open without counting on the breaker (Redis was not the one that was late)."""
    monkeypatch.setattr(gate_module, "LOOP_EXTENSIONS", extensions)
    store = RedisStore.from_url(redis_single_clean.url, deadline=DEADLINE)
    try:
        await store.ping()
        engine = engine_on(store, tmp_path, busy=True, before_write=True)
        _, decision = await engine.check(get())
        # the deadline passed in this server (queued, or the answer not carried yet), never
        # counted against Redis, which answered within a deadline of the write
        missed = engine.gate.deadline_missed
        assert missed["queued"] + missed["loop"] >= 1 and missed["redis"] == 0
        if extensions:
            assert decision.allowed and decision.failures == () and engine.failures == {}
        else:
            assert decision.failures == ("timeout",)
        assert engine.gate.breaker.failures == 0 and engine.gate.breaker.state == "closed"
    finally:
        await store.close()


async def test_a_half_open_probe_late_in_this_server_is_given_up(
        redis_single_clean: RedisSingle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-open breaker's probe whose deadline passes in this server (the loop, not Redis)
    counts no outcome, and gives the probe up: the next check probes, and the breaker closes
    (before, the probe stayed taken and every later check failed open ``circuit_open``)."""
    monkeypatch.setattr(gate_module, "LOOP_EXTENSIONS", 0)
    store = RedisStore.from_url(redis_single_clean.url, deadline=DEADLINE)
    busy = [True]

    async def check(ops: Sequence[Op], lease_id: str) -> CheckResult:
        call = asyncio.ensure_future(store.check(ops, lease_id))
        if busy[0]:
            await written(store)
            time.sleep(BUSY)  # noqa: ASYNC251 - the point: nothing runs, nothing is read
        return await call

    try:
        await store.ping()
        engine = Engine(StoreGate(store, DEADLINE, breaker=Breaker(SYSTEM_CLOCK, threshold=1, ratio=0.0),
                                  store_check=check),
                        policy_from(tmp_path, {"limiters": [RATE]}))
        engine.gate.breaker.open_until = SYSTEM_CLOCK.monotonic() - 1  # half-open: the next call probes
        _, decision = await engine.check(get())
        assert decision.failures == ("timeout",) and engine.gate.deadline_missed["redis"] == 0
        busy[0] = False
        _, decision = await engine.check(get())
        assert decision.failures == () and decision.allowed, decision.failures
        assert engine.gate.breaker.state == "closed"
    finally:
        await store.close()


async def test_a_stalled_store_still_fails_open(redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    store = RedisStore.from_url(redis_single_clean.url, deadline=DEADLINE)
    try:
        await store.ping()
        engine = engine_on(store, tmp_path, busy=False)
        redis_single_clean.pause()
        try:
            _, decision = await engine.check(get())
        finally:
            redis_single_clean.resume()
        assert decision.allowed and decision.failures == ("timeout",)
        assert decision.verdicts[0].reason == "store_timeout"
        # the command waited the whole deadline: late at once, at worst after one more
        assert engine.gate.deadline_extended <= 1
        # the store was late: counted so, and on the breaker (here: open at one failure)
        assert engine.gate.deadline_missed["redis"] == 1
        assert engine.gate.breaker.state == "open"
    finally:
        await store.close()


async def test_a_check_waiting_for_a_connection_fails_open_at_the_deadline(tmp_path: Path) -> None:
    """A Redis that accepts the TCP connection and never answers the handshake: the first
    check waits for a connection that does not come; that is the store being late, not
    this server's loop: no extension."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes connects; nobody ever answers
    port = listener.getsockname()[1]
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}", deadline=DEADLINE)
    try:
        engine = engine_on(store, tmp_path, busy=False)
        _, decision = await engine.check(get())
        assert decision.allowed and decision.failures == ("timeout",)
        assert engine.gate.deadline_extended == 0
    finally:
        await store.close()
        listener.close()


async def test_a_failed_open_grant_op_gives_its_grant_back(redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    """Issue 29: a batched request_rate grant op whose check failed open (here: Redis paused
    past the deadline) still runs when Redis resumes and takes its grant from the shared
    bucket; nothing held it, so each abandoned grant cost the key ``batch`` tokens for no
    request and one replica refused while its bucket had been spent on nothing. Now the
    late answer's grant goes back, less the failed-open request's own cost (what exact mode's
    late commit takes): afterwards the key admits what exact mode would. The clock is
    frozen (injected), so the bucket never refills: the counts are exact."""
    clock = ManualClock(5_000.0)
    store = make_redis_store(redis_single_clean, clock, socket_timeout=30.0)
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "user-rate", "type": "request_rate", "rate": 1, "burst": 10,
        "consistency": "batched", "batch": 5, "sync_interval": "10s"}]})
    engine = Engine(StoreGate(store, 0.05, clock=clock, breaker=Breaker(clock, threshold=10**9)), policy)
    bucket = engine.keys.bucket("user-rate", engine.context(get()).identity)
    raw = redis.Redis(port=redis_single_clean.port)
    try:
        await store.ping()
        redis_single_clean.pause()
        try:
            _, decision = await engine.check(get())  # written, unanswered: fails open
        finally:
            redis_single_clean.resume()
        assert decision.allowed and decision.failures == ("timeout",)
        # the late answer runs (the grant of 5 taken), then its give-back
        await wait_until(lambda: _true(raw.get(bucket) is not None), 10.0, "the late grant")
        await wait_until(lambda: _true(engine.grants.abandoned_returns == 1 and not engine.grants._returning), 10.0,
                         "its give-back")
        assert engine.grants.abandoned_return_errors == 0
        admitted = [(await engine.check(get()))[1].allowed for _ in range(12)]
        # exact mode: 10 tokens, the failed-open request's late commit took 1: 9 admitted
        # (before: the lost grant left 5, and the key refused after 5)
        assert admitted == [True] * 9 + [False] * 3
    finally:
        for lim in engine.snapshot.limiters:
            if isinstance(lim, RequestRateLimiter) and lim.grants is not None:
                lim.grants.close()
        raw.close()
        await store.close()


async def _true(value: bool) -> bool:
    return value


async def test_a_grant_op_skipped_by_the_open_breaker_gives_back_what_it_lent(
        redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    """A request whose grant ran short lends the remainder to its grant op (``held``: the
    store counts it in the pool it grants from). When the open breaker skips the store, the
    op is never sent: the remainder goes back to the shared bucket instead of being lost."""
    clock = ManualClock(5_000.0)
    store = make_redis_store(redis_single_clean, clock)
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "user-rate", "type": "request_rate", "rate": 1, "burst": 10, "cost": 3,
        "consistency": "batched", "batch": 4, "sync_interval": "10s"}]})
    engine = Engine(StoreGate(store, 1.0, clock=clock, breaker=Breaker(clock, threshold=1, ratio=0.0)), policy)
    bucket = engine.keys.bucket("user-rate", engine.context(get()).identity)
    raw = redis.Redis(port=redis_single_clean.port)

    def tokens() -> float:
        value = raw.get(bucket)
        assert value is not None
        return float(value.split()[0])

    try:
        _, first = await engine.check(get())  # a grant of 4, 3 spent: 1 left here, 6 in Redis
        assert first.allowed and first.failures == () and tokens() == 6.0
        engine.gate.breaker.failure()  # open
        _, second = await engine.check(get())  # 1 < 3: lent to a grant op the breaker skips
        assert second.allowed and second.failures == ("circuit_open",)
        await wait_until(lambda: _true(engine.grants.abandoned_returns == 1 and not engine.grants._returning), 10.0,
                         "the give-back")
        assert tokens() == 7.0  # the remainder is back in the shared bucket (before: lost)
    finally:
        for lim in engine.snapshot.limiters:
            if isinstance(lim, RequestRateLimiter) and lim.grants is not None:
                lim.grants.close()
        raw.close()
        await store.close()
