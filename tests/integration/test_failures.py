"""No exception escapes: a client-library bug in the store call, a limiter bug, a request the
edge cannot read and a failing background job are each decided safely and counted once, by
reason, on the real server (gRPC Check, /metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest, RequestContext
from extauthz.core.runner import DONE, Runner
from extauthz.core.verdict import Outcome
from extauthz.engine.engine import Engine
from extauthz.limiters import Limiter
from extauthz.server.services import AuthorizationService
from extauthz.store.base import Op
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisSingle
from tests.observe.helpers import eventually, rate, running, samples, scrape, value, write_policy


class OldClientRedisStore(RedisStore):
    """A real RedisStore whose client library breaks the way redis-py 5.0.x did
    (``pool.get_connection()`` with no arguments raised ``TypeError``)."""

    async def _transmit(self, batch: Any) -> Any:
        await self._ensure_ready()
        raise TypeError("get_connection() missing 1 required positional argument: 'command_name'")


class KeyErrorLimiter:
    """A real limiter whose ``op`` hits a bug (``KeyError``); everything else delegates."""

    def __init__(self, inner: Limiter) -> None:
        self.inner = inner

    def op(self, ctx: RequestContext, enforce: bool) -> Op | None:
        raise KeyError("tier")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def break_limiters(engine: Engine) -> None:
    snap = engine.snapshot
    engine.snapshot = dataclasses.replace(
        snap, active=tuple((KeyErrorLimiter(lim), enforce) for lim, enforce in snap.active))


@pytest.mark.redis
async def test_a_client_library_type_error_fails_checks_open_counted_as_internal_error(
    tmp_path: Path, redis_single_clean: RedisSingle, caplog: pytest.LogCaptureFixture
) -> None:
    store = OldClientRedisStore.from_url(redis_single_clean.url, deadline=0.25)
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], store=store, store_deadline_ms=250) as (server, client):
        assert [await client.check(f"sk_live_{i}") for i in range(3)] == [200, 200, 200]
        m = samples(await scrape(server))
        assert value(m, "extauthz_fail_open_total", reason="internal_error") == 3
        assert value(m, "extauthz_decisions_total", limiter="user-rate", tier="get", plan="",
                     outcome="failed_open") == 3
        assert server.engine.failures == {"internal_error": 3}
    # One log line with the traceback for the streak, not one per request.
    bugs = [r for r in caplog.records if "unexpected error from the store call" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None


async def test_a_limiter_raising_key_error_fails_open_counted(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], store=MemoryStore(ManualClock())) as (server, client):
        break_limiters(server.engine)
        assert await client.check() == 200
        assert await client.check() == 200
        m = samples(await scrape(server))
        assert value(m, "extauthz_fail_open_total", reason="internal_error") == 2
        assert value(m, "extauthz_decisions_total", limiter="user-rate", tier="get", plan="",
                     outcome="failed_open") == 2


async def test_a_failure_mode_closed_limiter_answers_503_on_a_bug(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [{**rate("user-rate", burst=5), "failure_mode": "closed"}])
    async with running([policy], store=MemoryStore(ManualClock())) as (server, client):
        break_limiters(server.engine)
        assert await client.check() == 503
        _, decision = await server.engine.check(RawRequest("GET", "/v1/x", headers={"x-api-key": "k"}))
        assert decision.verdicts[0].outcome is Outcome.FAILED_CLOSED
        assert decision.failures == ("internal_error",)
        m = samples(await scrape(server))
        assert value(m, "extauthz_requests_total", tier="get", result="failed_closed") == 2
        assert value(m, "extauthz_fail_open_total", reason="internal_error") == 2


async def test_a_request_the_edge_cannot_read_is_allowed_and_counted_at_the_edge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], store=MemoryStore(ManualClock())) as (server, _client):
        service: AuthorizationService = server.auth
        for _ in range(3):
            resp = await service.Check(None, None)  # not a CheckRequest at all
            assert resp.HasField("ok_response")
        m = samples(await scrape(server))
        assert value(m, "extauthz_bad_requests_total") == 3
        assert "internal_error" not in server.engine.failures  # the edge's count, not the engine's
    lines = [r for r in caplog.records if "could not read a CheckRequest" in r.getMessage()]
    assert len(lines) == 1  # rate-limited


async def test_a_background_job_that_raises_keeps_running_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = Runner()
    ticks = 0
    finished = asyncio.Event()

    def tick() -> object:
        nonlocal ticks
        ticks += 1
        if ticks <= 3:
            raise KeyError(f"bug {ticks}")
        finished.set()
        return DONE

    caplog.set_level(logging.WARNING, logger="extauthz.runner")
    runner.every("flaky", 0.001, tick, first=True)
    try:
        async with asyncio.timeout(10):
            await finished.wait()
    finally:
        await runner.stop()
    assert ticks == 4 and runner.errors == {"flaky": 3}
    assert len([r for r in caplog.records if "background job flaky failed" in r.getMessage()]) == 1


async def test_sampler_failures_are_background_errors_not_fail_opens(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [{
        "name": "workers", "type": "worker_utilization",
        "signal": {"source": "envoy_admin", "url": "http://127.0.0.1:9", "cluster": "c", "capacity": 10},
        "sample_interval": "100ms"}])
    async with running([policy], store=MemoryStore(ManualClock())) as (server, _client):
        await eventually(lambda: server.runner.errors.get("sampler:workers"), within=10)
        m = samples(await scrape(server))
        assert value(m, "extauthz_background_errors_total", job="sampler:workers") >= 1
        assert server.engine.failures == {}
        assert server.runner.running("sampler:workers")  # it keeps running
