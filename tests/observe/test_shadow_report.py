"""The dark-launch report: shadow would-denials are recorded off the request path into the
store's bounded event log, and ``extauthz report`` lists who would have been refused."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from extauthz.commands import cli
from extauthz.core.clock import ManualClock
from extauthz.observe.shadow import build_report, format_report
from extauthz.store.memory import MemoryStore

from .helpers import admin, identity_of, rate, running, write_policy


async def test_memory_event_log_is_bounded_and_expires(clock: ManualClock) -> None:
    store = MemoryStore(clock)
    await store.append_events("k", [f"e{i}" for i in range(5)], maxlen=3, ttl=10)
    assert await store.read_events("k", since=0) == ["e2", "e3", "e4"]
    clock.advance(2)
    await store.append_events("k", ["late"], maxlen=3, ttl=10)
    assert await store.read_events("k", since=clock.wall() - 1) == ["late"]
    clock.advance(10)
    assert await store.read_events("k", since=0) == []
    assert await store.read_events("missing", since=0) == []


def test_report_groups_sums_and_ranks() -> None:
    ev = [
        {"ts": 1, "limiter": "a", "tier": "get", "route": "GET /x", "identity": "i1", "identity_source": "h",
         "count": 3, "min_headroom": 0.2, "reason": "rate_exceeded", "plan": "free"},
        {"ts": 2, "limiter": "a", "tier": "post", "route": "POST /y", "identity": "i1", "identity_source": "h",
         "count": 2, "min_headroom": 0.0, "reason": "rate_exceeded", "plan": "free"},
        {"ts": 3, "limiter": "a", "tier": "get", "route": "GET /x", "identity": "i2", "identity_source": "h",
         "count": 1, "min_headroom": None, "reason": "rate_exceeded"},
        {"ts": 4, "limiter": "b", "tier": "get", "route": "GET /x", "identity": "i2", "identity_source": "h",
         "count": 9, "min_headroom": 0.5, "reason": "concurrency_exceeded"},
    ]
    report = build_report([json.dumps(e) for e in ev] + ["not json", "{}"], top=1)
    assert [r["limiter"] for r in report] == ["b", "a"]
    a = report[1]
    assert a["would_deny"] == 6 and a["identities"] == 2 and a["routes"] == 2
    assert a["tiers"] == {"get": 4, "post": 2}
    assert a["plans"] == {"free": 5}  # the plan is a label of the report (events without one: none)
    assert a["top_identities"] == [{"identity": "i1", "identity_source": "h", "count": 5, "min_headroom": 0.0,
                                    "tiers": ["get", "post"], "plans": ["free"], "routes": 2}]
    assert a["top_routes"] == [{"route": "GET /x", "count": 4, "min_headroom": 0.2, "identities": 2}]
    text = format_report({"window": 60, "events": 4, "limiters": report})
    assert "limiter a: 6 would-denials, 2 identities" in text and "i1" in text
    assert "plans: free 5" in text


def test_malformed_events_in_the_shadow_log_are_skipped() -> None:
    # The shadow log is a Redis stream anyone who can write Redis can add to: an event nested
    # too deeply (RecursionError) or with an infinite count (OverflowError) made the report,
    # and /shadow, fail (500) instead of skipping that one event.
    good = json.dumps({"ts": 1, "limiter": "a", "identity": "i1", "count": 2})
    report = build_report(["[" * 100_000, '{"limiter": "b", "count": Infinity}',
                           '{"limiter": "c", "count": NaN}', good])
    assert [(r["limiter"], r["would_deny"]) for r in report] == [("a", 2)]
    # a headroom that is not a number is no headroom (it was compared with numbers: TypeError)
    odd = json.dumps({"ts": 2, "limiter": "a", "identity": "i1", "min_headroom": "x"})
    report = build_report([json.dumps({"ts": 1, "limiter": "a", "identity": "i1", "min_headroom": 0.5}), odd])
    assert report[0]["would_deny"] == 2 and report[0]["top_identities"][0]["min_headroom"] == 0.5


async def test_the_report_lists_who_a_shadow_limiter_would_have_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=100),
                                               rate("dark", burst=2, mode="shadow")])
    async with running([policy]) as (server, client):
        for _ in range(5):  # 2 fit the shadow bucket, 3 would have been refused
            assert await client.check("sk_live_alice", path="/v1/charges", method="POST") == 200
        for _ in range(4):  # 2 would have been refused, on two routes
            assert await client.check("sk_live_bob", path="/v1/customers") == 200
        assert await client.check("sk_live_bob", path="/v1/invoices") == 200
        assert await client.check("sk_live_carol") == 200  # within the shadow limit

        code, report = await admin(server, "GET", "/shadow?window=1h")
        assert code == 200 and report["window"] == 3600
        (dark,) = report["limiters"]
        assert dark["limiter"] == "dark" and dark["would_deny"] == 6
        who = {i["identity"]: i["count"] for i in dark["top_identities"]}
        assert who == {identity_of("sk_live_alice"): 3, identity_of("sk_live_bob"): 3}
        assert identity_of("sk_live_carol") not in who
        routes = {r["route"]: r["count"] for r in dark["top_routes"]}
        assert routes == {"POST /v1/charges": 3, "GET /v1/customers": 2, "GET /v1/invoices": 1}
        assert all(i["min_headroom"] == 0.0 for i in dark["top_identities"])
        assert dark["tiers"] == {"post": 3, "get": 3}
        assert dark["reasons"] == {"rate_exceeded": 6}

        capsys.readouterr()
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        assert await asyncio.to_thread(cli.main, ["report", "--admin", url, "--window", "15m"]) == 0
        out = capsys.readouterr().out
        assert "limiter dark: 6 would-denials, 2 identities, 3 routes" in out
        assert identity_of("sk_live_alice") in out and identity_of("sk_live_carol") not in out
        assert "POST /v1/charges" in out and "sk_live" not in out
        # Outside the window: nothing.
        server.clock.advance(10)  # type: ignore[attr-defined]
        _, later = await admin(server, "GET", "/shadow?window=5")
        assert later["limiters"] == []
        code, bad = await admin(server, "GET", "/shadow?window=soon")
        assert code == 400 and "bad duration" in bad["error"]


@pytest.mark.redis
async def test_redis_event_log_functions(redis_single_clean) -> None:  # type: ignore[no-untyped-def]
    from redis.asyncio import Redis

    from extauthz.store.redis_events import append_events, read_events

    client = Redis.from_url(redis_single_clean.url)
    try:
        t0 = time.time()
        await append_events(client, "log", [json.dumps({"n": i}) for i in range(1000)], maxlen=100, ttl=60)
        events = await read_events(client, "log", since=t0 - 5)
        assert 100 <= len(events) < 1000  # MAXLEN ~ trims whole nodes: at least 100 kept
        assert json.loads(events[-1]) == {"n": 999}
        assert 0 < await client.ttl("log") <= 60
        assert await read_events(client, "log", since=time.time() + 60) == []
        assert await read_events(client, "missing", since=0) == []
        await append_events(client, "log", [], maxlen=100, ttl=60)  # nothing to do
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_report_over_redis_from_two_replicas(tmp_path: Path, redis_single_clean,  # type: ignore[no-untyped-def]
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.store import redis_events
    from extauthz.store.redis import RedisStore

    class Store(RedisStore):  # the wiring RedisStore gets: delegate to redis_events
        async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
            await redis_events.append_events(self.client, key, events, maxlen, ttl)

        async def read_events(self, key: str, since: float) -> list[str]:
            return await redis_events.read_events(self.client, key, since)

    url = redis_single_clean.url
    policy = write_policy(tmp_path / "p.yaml", [rate("dark", burst=1, mode="shadow")])
    async with running([policy], store=Store.from_url(url, deadline=0.25), key_prefix="rp") as (a, ca), \
            running([policy], store=Store.from_url(url, deadline=0.25), key_prefix="rp") as (b, cb):
        for client in (ca, cb, ca, cb):  # one shared bucket: 3 would-denials over two replicas
            assert await client.check("sk_live_dave") == 200
        await a.observe.shadow.flush()
        await b.observe.shadow.flush()
        capsys.readouterr()
        code = await asyncio.to_thread(cli.main, ["report", "--redis-url", url, "--key-prefix", "rp", "--json"])
        assert code == 0
        report = json.loads(capsys.readouterr().out)
        (dark,) = report["limiters"]
        assert dark["would_deny"] == 3
        assert [i["identity"] for i in dark["top_identities"]] == [identity_of("sk_live_dave")]


async def test_a_flush_waits_for_the_flush_already_writing(clock: ManualClock) -> None:
    """``flush()`` called while the background flush is writing (``GET /shadow``, stop, a
    test) returns only once what was noted before it is in the store: it must not find the
    buffer already swapped out and return at once, leaving the report to miss those events."""
    from extauthz.core.context import RequestContext
    from extauthz.core.tiers import Tier
    from extauthz.core.verdict import Decision, Kind, Outcome, Verdict
    from extauthz.observe.shadow import ShadowRecorder

    class GatedStore(MemoryStore):
        def __init__(self) -> None:
            super().__init__(clock)
            self.entered = asyncio.Event()
            self.gate = asyncio.Event()

        async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
            self.entered.set()
            await self.gate.wait()
            await super().append_events(key, events, maxlen, ttl)

    store = GatedStore()
    recorder = ShadowRecorder(store, "shadow", clock=clock)
    tier = next(iter(Tier))
    ctx = RequestContext(tier=tier, identity="i1", identity_source="header:x-api-key", test_mode=False,
                         method="GET", path="/x", host="h", tier_source="default")
    verdict = Verdict("dark", Kind.RATE_LIMITER, Outcome.SHADOW_DENIED, limit=1, remaining=0,
                      reason="rate_exceeded")
    recorder.decided(ctx, Decision(allowed=True, tier=tier, verdicts=(verdict,)), None)  # type: ignore[arg-type]
    background = asyncio.create_task(recorder.flush())
    await store.entered.wait()  # the background flush took the buffer and is writing
    explicit = asyncio.create_task(recorder.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not explicit.done(), "flush() returned while the noted events were still being written"
    store.gate.set()
    assert await background == 1
    assert await explicit == 0
    (event,) = await store.read_events("shadow", since=0)
    assert json.loads(event)["limiter"] == "dark"


async def test_the_dark_launch_report_names_the_key_a_keyed_shadow_limiter_counts(tmp_path: Path) -> None:
    """A shadow per-IP limit and a shadow quota: their would-refusals are grouped by what
    each counts (the hashed client IP for the keyed one, the identity for the quota)."""
    from extauthz.core.context import RawRequest
    from extauthz.engine.engine import Engine
    from extauthz.engine.storegate import StoreGate
    from extauthz.observe.shadow import ShadowRecorder
    from extauthz.policy import load_policy

    (tmp_path / "p.yaml").write_text(
        "version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
        "  - {name: per-ip, type: request_rate, rate: 0.001, burst: 1, mode: shadow, key: [{source_ip: true}]}\n"
        "  - {name: daily, type: quota, limit: 1, period: day, mode: shadow}\n")
    clock = ManualClock()
    store = MemoryStore(clock)
    recorder = ShadowRecorder(store, "shadow", clock=clock)
    engine = Engine(StoreGate(store, clock=clock), load_policy([tmp_path / "p.yaml"]), observer=recorder)
    for key in ("sk_a", "sk_b", "sk_a"):
        _, d = await engine.check(RawRequest("GET", "/x", headers={"x-api-key": key}, source_ip="10.0.0.9"))
        assert d.allowed
    await recorder.flush()
    report = {r["limiter"]: r for r in build_report(await store.read_events("shadow", since=0))}
    ip = report["per-ip"]
    assert (ip["would_deny"], ip["identities"]) == (2, 1)
    assert ip["top_identities"][0]["identity_source"] == "key:source_ip"
    assert ip["top_identities"][0]["identity"] == engine.context(
        RawRequest("GET", "/x", source_ip="10.0.0.9")).keys[0][0]
    daily = report["daily"]
    assert (daily["would_deny"], daily["reasons"]) == (1, {"quota_exceeded": 1})
    assert daily["top_identities"][0]["identity_source"] == "header:x-api-key"
