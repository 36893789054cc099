"""The one release path: counted by path and outcome, errors never lost, drained on stop."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.engine import Engine
from extauthz.engine.release import PATHS, Releaser
from extauthz.engine.storegate import StoreGate
from extauthz.server.app import Server, ServerConfig
from extauthz.store.base import LeaseOp
from extauthz.store.memory import MemoryStore

from .helpers import FaultyStore, get, policy_from


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the event loop's exception handler ("Task exception was never
    retrieved" among others); the test asserts it stays empty."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    gc.collect()  # a task destroyed with an unretrieved exception reports here
    loop.set_exception_handler(previous)


async def test_embedded_store_releases_at_once_and_counts_by_path() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    releaser = Releaser(store)
    result = await store.check([LeaseOp("k", 2, 30)], "lease-1")
    assert result.admitted
    assert releaser.release(["k"], "lease-1", "access_log") is None  # no task
    assert releaser.release(["k"], "lease-1", "request_id_index") is None
    assert releaser.counts[("access_log", "released")] == 1
    assert releaser.counts[("request_id_index", "none")] == 1  # already given back
    assert releaser.leases_released == 1
    assert await store.inflight(["k"]) == [0]
    with pytest.raises(ValueError, match="unknown release path"):
        releaser.release(["k"], "lease-1", "elsewhere")


async def test_failing_background_release_is_counted_and_never_unretrieved(
    loop_errors: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    store = FaultyStore(MemoryStore(ManualClock()), release_error=TypeError("client bug"))
    releaser = Releaser(store)
    tasks = [releaser.release(["k"], f"lease-{i}", path) for i, path in enumerate(PATHS)]
    assert all(t is not None for t in tasks) and len(releaser.pending) == len(PATHS)
    await releaser.drain()
    for path in PATHS:
        assert releaser.counts[(path, "error")] == 1
        assert releaser.counts[(path, "released")] == 0
    assert not releaser.pending
    # Logged once (rate-limited), not once per failure.
    logged = [r for r in caplog.records if "lease release" in r.getMessage()]
    assert len(logged) == 1 and "TypeError: client bug" in logged[0].getMessage()
    del tasks
    gc.collect()
    assert loop_errors == []


async def test_abandoned_store_answer_is_released_through_the_releaser(tmp_path: Path) -> None:
    """The engine's deadline passes while the store call is out: the Check fails open, and
    when the answer lands its lease is given back on the ``abandoned_answer`` path."""
    clock = ManualClock()
    policy = policy_from(tmp_path, {"limiters": [{"name": "conc", "type": "concurrent_requests",
                                                  "limit": 5}]})
    inner = MemoryStore(clock)
    gate = asyncio.Event()

    class SlowStore(FaultyStore):
        async def check(self, ops: Any, lease_id: str) -> Any:
            await gate.wait()
            return await self.inner.check(ops, lease_id)

    store = SlowStore(inner)
    engine = Engine(StoreGate(store, clock=clock, deadline=0.01), policy)
    _, decision = await engine.check(get())
    assert decision.allowed and decision.failures == ("timeout",)
    gate.set()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if engine.releaser.count("abandoned_answer") and not engine.releaser.pending:
            break
    assert engine.releaser.counts[("abandoned_answer", "released")] == 1
    assert inner.live_leases() == {}


async def test_an_answer_read_in_the_deadlines_loop_turn_is_used(tmp_path: Path) -> None:
    """The store's answer is read in the same event-loop turn as the deadline fires (a busy
    loop): asyncio wakes the Check with TimeoutError, but the answer is there: it is used,
    not failed open."""
    clock = ManualClock()
    policy = policy_from(tmp_path, {"limiters": [{"name": "conc", "type": "concurrent_requests",
                                                  "limit": 5}]})
    inner = MemoryStore(clock)
    deadline = 0.02

    class AnswersJustInTime(FaultyStore):
        async def check(self, ops: Any, lease_id: str) -> Any:
            loop = asyncio.get_running_loop()
            landed = loop.create_future()
            loop.call_later(deadline / 2, landed.set_result, None)       # the reply is read...
            loop.call_soon(time.sleep, 2 * deadline)                      # ...by a loop busy past both
            await landed
            return await self.inner.check(ops, lease_id)

    engine = Engine(StoreGate(AnswersJustInTime(inner), clock=clock, deadline=deadline), policy)
    _, decision = await engine.check(get())
    assert decision.allowed and decision.failures == ()
    assert len(inner.live_leases()) == 1 and engine.releaser.count("abandoned_answer") == 0


async def test_server_stop_waits_for_pending_releases_before_closing_the_store(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"limiters": [{"name": "conc", "type": "concurrent_requests",
                                                  "limit": 5}]})
    inner = MemoryStore(ManualClock())
    store = FaultyStore(inner, release_delay=0.15)
    # store deadline 20 ms: a background release may take 200 ms
    srv = Server(ServerConfig(listen="127.0.0.1:0", admin_listen="off", store_deadline_ms=20),
                 policy=policy, store=store)
    await srv.start()
    _, decision = await srv.engine.check(get())
    assert decision.leases
    task = srv.engine.releaser.release(decision.leases, decision.lease_id, "cancelled_check")
    assert task is not None
    await srv.stop(grace=0)
    assert store.closed and store.releases == 1
    assert srv.engine.releaser.counts[("cancelled_check", "released")] == 1
    assert inner.live_leases() == {}


async def wait_for_count(releaser: Releaser, key: tuple[str, str], n: int) -> None:
    for _ in range(2000):
        if releaser.counts[key] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{key} never reached {n}: {releaser.counts}")


async def test_a_failed_release_is_retried_until_it_succeeds(loop_errors: list[dict[str, Any]]) -> None:
    """Issue 20 defect 9: before, one failure left the slot held until the lease TTL."""
    inner = MemoryStore(ManualClock())
    assert (await inner.check([LeaseOp("k", 1, 60)], "lease-1")).admitted
    store = FaultyStore(inner, release_error=ConnectionError("failover"))
    releaser = Releaser(store, retry_for=lambda: 60.0)
    task = releaser.release(["k"], "lease-1", "access_log")
    assert task is not None
    await wait_for_count(releaser, ("access_log", "retried"), 2)
    assert await inner.inflight(["k"]) == [1]
    store.release_error = None  # the store is back
    assert await task == 1
    assert await inner.inflight(["k"]) == [0]
    assert releaser.counts[("access_log", "released")] == 1
    assert releaser.counts[("access_log", "error")] == 0 and not releaser.pending
    assert loop_errors == []


async def test_a_release_failing_past_the_lease_ttl_gives_up_once() -> None:
    store = FaultyStore(MemoryStore(ManualClock()), release_error=ConnectionError("down"))
    releaser = Releaser(store, retry_for=lambda: 0.3)
    task = releaser.release(["k"], "lease-1", "cancelled_check")
    assert task is not None and await task == 0
    assert releaser.counts[("cancelled_check", "error")] == 1
    assert releaser.counts[("cancelled_check", "retried")] >= 1


async def test_drain_cancels_a_retrying_release_and_counts_it_failed() -> None:
    store = FaultyStore(MemoryStore(ManualClock()), release_error=ConnectionError("down"))
    releaser = Releaser(store, retry_for=lambda: 60.0)
    releaser.release(["k"], "lease-1", "access_log")
    await wait_for_count(releaser, ("access_log", "retried"), 1)
    await releaser.drain(within=0.1)
    assert not releaser.pending and releaser.counts[("access_log", "error")] == 1


async def test_drain_cancelling_a_release_in_its_store_call_counts_it_failed() -> None:
    """Cancelled while the store call is on its way (not between tries): counted failed too
    (before, only a cancel during the backoff sleep was; CI caught the other one)."""
    store = FaultyStore(MemoryStore(ManualClock()), release_delay=60.0)
    releaser = Releaser(store, timeout=120.0, retry_for=lambda: 60.0)
    releaser.release(["k"], "lease-1", "access_log")
    await asyncio.sleep(0)  # the store call has started
    await releaser.drain(within=0.0)
    assert not releaser.pending and releaser.counts[("access_log", "error")] == 1


async def test_the_engine_retries_releases_for_the_longest_lease_ttl(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"limiters": [{"name": "conc", "type": "concurrent_requests",
                                                  "limit": 5, "lease_ttl": "45s"}]})
    engine = Engine(StoreGate(FaultyStore(MemoryStore(ManualClock()))), policy)
    assert engine.releaser.retry_for is not None and engine.releaser.retry_for() == 45.0


async def test_at_most_max_retrying_releases_wait_for_a_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    import extauthz.engine.release

    monkeypatch.setattr(extauthz.engine.release, "MAX_RETRYING", 3)
    store = FaultyStore(MemoryStore(ManualClock()), release_error=ConnectionError("down"))
    releaser = Releaser(store, retry_for=lambda: 60.0)
    tasks = [releaser.release(["k"], f"lease-{i}", "access_log") for i in range(5)]
    await wait_for_count(releaser, ("access_log", "error"), 2)  # the two beyond the bound
    assert releaser.retrying == 3 and len(releaser.pending) == 3
    await releaser.drain(within=0.05)
    assert releaser.retrying == 0 and releaser.counts[("access_log", "error")] == 5
    del tasks
