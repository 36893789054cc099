"""Limiter keys (``key:``, ``on_missing_key``) and the ``quota`` limiter through the engine
on every store (embedded, single Redis, Redis Cluster, Sentinel): issue 21's "Done when"."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from extauthz.control.overrides import make_override
from extauthz.core.context import RawRequest
from extauthz.engine.answers import denial, ratelimit_headers
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.observe.base import Observer
from extauthz.observe.metrics import Metrics
from testinfra.probes import release_and_wait

from ..unit.helpers import get, policy_from
from .conftest import StoreCase


def engine(case: StoreCase, tmp_path: Path, limiters: list[dict[str, Any]], observer: Observer | None = None,
           **doc: Any) -> Engine:
    policy = policy_from(tmp_path, {"limiters": limiters, **doc})
    return Engine(StoreGate(case.store, clock=case.clock, deadline=1.0), policy, rng=random.Random(7),
                  observer=observer)


def req(key: str = "", ip: str = "10.0.0.1", method: str = "POST", path: str = "/v1/login",
        host: str = "", **headers: str) -> RawRequest:
    return get(path, key=key, method=method, source_ip=ip, host=host,
               headers={k.replace("_", "-"): v for k, v in headers.items()})


async def allowed(e: Engine, raw: RawRequest) -> bool:
    return (await e.check(raw))[1].allowed


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


PER_IP = {"name": "login-per-ip", "type": "request_rate", "rate": 0.001, "burst": 5,
          "key": [{"source_ip": True}], "applies_to": {"path_prefix": "/v1/login"}}
PER_KEY = {"name": "per-key", "type": "request_rate", "rate": 0.001, "burst": 5,
           "key": [{"header": "x-api-key"}]}


async def test_two_limiters_keyed_differently_refuse_independently(store_case: StoreCase,
                                                                   tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [PER_IP, PER_KEY])
    # one client IP with five API keys (and more) hits the per-IP limit
    assert [await allowed(e, req(f"sk_{i}", "10.0.0.1")) for i in range(6)] == [True] * 5 + [False]
    _, d = await e.check(req("sk_new", "10.0.0.1"))
    assert d.denied_by is not None and d.denied_by.limiter == "login-per-ip"
    # one API key from five IPs (and more) hits the per-key limit
    assert [await allowed(e, req("sk_one", f"10.1.0.{i}")) for i in range(6)] == [True] * 5 + [False]
    _, d = await e.check(req("sk_one", "10.1.0.99"))
    assert d.denied_by is not None and d.denied_by.limiter == "per-key"
    # the others are untouched
    assert await allowed(e, req("sk_other", "10.2.0.1"))


async def test_a_per_user_per_method_key_keeps_get_and_post_apart(store_case: StoreCase,
                                                                  tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "user-method", "type": "request_rate", "rate": 0.001,
                                       "burst": 2, "key": [{"identity": True}, {"method": True}]}])
    assert [await allowed(e, req("sk_a", method="POST")) for _ in range(3)] == [True, True, False]
    assert [await allowed(e, req("sk_a", method="GET")) for _ in range(3)] == [True, True, False]
    assert await allowed(e, req("sk_b", method="POST"))  # another user


async def test_a_request_without_the_keyed_header_skips_the_limiter(store_case: StoreCase,
                                                                    tmp_path: Path) -> None:
    metrics = Metrics()  # given at construction, as the server does (nothing set afterwards)
    e = engine(store_case, tmp_path, [{"name": "per-org", "type": "request_rate", "rate": 0.001,
                                       "burst": 1, "key": [{"header": "x-org"}]}], observer=metrics)
    metrics.prime(e.snapshot.policy)
    for _ in range(5):  # no x-org: the limiter does not apply, counted
        _, d = await e.check(req("sk_a"))
        assert d.allowed and d.verdicts == () and d.skipped == ("per-org",)
    assert metrics.skipped.labels("per-org", "key_missing")._value.get() == 5
    assert [await allowed(e, req("sk_a", x_org="acme")) for _ in range(2)] == [True, False]
    assert await allowed(e, req("sk_a", x_org="initech"))


async def test_on_missing_key_shared_puts_keyless_requests_in_one_bucket(store_case: StoreCase,
                                                                         tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "per-org", "type": "request_rate", "rate": 0.001,
                                       "burst": 2, "key": [{"header": "x-org"}],
                                       "on_missing_key": "shared"}])
    # two different users without x-org share one bucket
    assert [await allowed(e, req(f"sk_{i}")) for i in range(3)] == [True, True, False]
    assert await allowed(e, req("sk_0", x_org="acme"))  # a keyed request has its own


async def test_keyed_concurrency_limit(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "conc-route", "type": "concurrent_requests", "limit": 1,
                                       "key": [{"identity": True}, {"host": True}]}])
    _, first = await e.check(req("sk_a", host="api.example.com:443"))
    assert first.allowed and first.leases
    assert not await allowed(e, req("sk_a", host="API.example.com"))  # the same host, no port
    assert await allowed(e, req("sk_a", host="eu.example.com"))
    assert await release_and_wait(e.releaser, first.leases, first.lease_id, "access_log") == 1
    assert await allowed(e, req("sk_a", host="api.example.com"))


QUOTA = {"name": "monthly", "type": "quota", "limit": 3, "period": "month"}


async def test_a_quota_refuses_after_limit_until_the_window_ends(store_case: StoreCase,
                                                                 tmp_path: Path) -> None:
    store_case.clock.set(utc("2026-01-31T23:59:00"))
    e = engine(store_case, tmp_path, [QUOTA])
    assert [await allowed(e, req("sk_a")) for _ in range(4)] == [True, True, True, False]
    ctx, d = await e.check(req("sk_a"))
    assert d.http_status == 429 and d.denied_by is not None
    answer = denial(ctx, d)
    headers = dict(answer.headers)
    assert headers["retry-after"] == "60"  # the month ends in a minute
    assert headers["ratelimit-policy"] == f'"monthly";q=3;w={31 * 86400}'
    assert headers["ratelimit"] == '"monthly";r=0;t=60'
    body = json.loads(answer.body)
    assert body["limiter"] == "monthly" and body["reset"] == "2026-02-01T00:00:00Z"
    assert body["type"] == "urn:extauthz:problem:quota_exceeded"
    assert await allowed(e, req("sk_b"))  # per identity
    store_case.clock.set(utc("2026-02-01T00:00:00"))  # a new month
    _, d = await e.check(req("sk_a"))
    assert d.allowed
    assert ratelimit_headers(d) == [("ratelimit-policy", f'"monthly";q=3;w={28 * 86400}'),
                                    ("ratelimit", f'"monthly";r=2;t={28 * 86400}')]


async def test_quota_cost_plans_overrides_and_shadow(store_case: StoreCase, tmp_path: Path) -> None:
    store_case.clock.set(utc("2026-03-04T10:00:00"))  # a Wednesday
    e = engine(store_case, tmp_path, [
        {"name": "weekly", "type": "quota", "limit": 4, "period": "week", "cost": 2,
         "plans": {"pro": {"limit": 6}}},
        {"name": "daily-shadow", "type": "quota", "limit": 1, "period": "day", "mode": "shadow"},
    ], plan={"from": [{"header": "x-plan"}], "default": "free"})
    assert [await allowed(e, req("sk_free")) for _ in range(3)] == [True, True, False]
    _, d = await e.check(req("sk_free"))
    assert d.denied_by is not None
    assert d.denied_by.retry_after == utc("2026-03-09T00:00:00") - utc("2026-03-04T10:00:00")  # Monday
    shadow = [v for v in d.verdicts if v.limiter == "daily-shadow"]
    assert shadow and shadow[0].outcome.value == "shadow_denied"
    assert [await allowed(e, req("sk_pro", x_plan="pro")) for _ in range(4)] == [True] * 3 + [False]
    ident = e.context(req("sk_big")).identity
    e.set_overrides([make_override("weekly", ident, {"limit": 10}, ttl="1h", now=store_case.clock.wall())])
    assert [await allowed(e, req("sk_big")) for _ in range(6)] == [True] * 5 + [False]


async def test_a_keyed_quota_per_route(store_case: StoreCase, tmp_path: Path) -> None:
    store_case.clock.set(utc("2026-03-04T10:00:00"))
    e = engine(store_case, tmp_path, [{"name": "per-route", "type": "quota", "limit": 1, "period": "hour",
                                       "key": [{"identity": True}, {"context_extension": "route"}]}])

    def on(route: str) -> RawRequest:
        return RawRequest("GET", "/x", headers={"x-api-key": "sk_a"}, context_extensions={"route": route})
    assert [await allowed(e, on("search")) for _ in range(2)] == [True, False]
    assert await allowed(e, on("export"))
    _, d = await e.check(RawRequest("GET", "/x", headers={"x-api-key": "sk_a"}))
    assert d.allowed and d.skipped == ("per-route",)
    store_case.clock.advance(50 * 60)  # 10:50: the same hour
    assert not await allowed(e, on("search"))
    store_case.clock.advance(10 * 60)  # 11:00
    assert await allowed(e, on("search"))


async def test_a_request_refused_elsewhere_takes_nothing_from_the_quota(store_case: StoreCase,
                                                                        tmp_path: Path) -> None:
    """The quota's count and a per-IP bucket live under different hash tags (two slots on a
    cluster): when the bucket refuses, the count the quota took is given back."""
    store_case.clock.set(utc("2026-03-04T10:00:00"))
    e = engine(store_case, tmp_path, [
        {"name": "daily", "type": "quota", "limit": 2, "period": "day"},
        {"name": "per-ip", "type": "request_rate", "rate": 0.001, "burst": 1, "key": [{"source_ip": True}]},
    ])
    assert await allowed(e, req("sk_a", "10.0.0.1"))
    for _ in range(3):
        _, d = await e.check(req("sk_a", "10.0.0.1"))
        assert d.denied_by is not None and d.denied_by.limiter == "per-ip"
    assert await allowed(e, req("sk_a", "10.0.0.2"))  # the quota's second request
    _, d = await e.check(req("sk_a", "10.0.0.3"))
    assert d.denied_by is not None and d.denied_by.limiter == "daily"


async def test_a_descriptor_with_zero_hits_is_checked_without_counting(store_case: StoreCase,
                                                                        tmp_path: Path) -> None:
    # ShouldRateLimit: a descriptor's own hits_addend of 0 checks only (envoyproxy/ratelimit)
    match = {"domain": "d", "descriptor": [{"key": "user"}]}
    e = engine(store_case, tmp_path, [
        {"name": "per-user-day", "type": "quota", "limit": 2, "period": "day", "match": match},
        {"name": "per-user-rate", "type": "request_rate", "rate": 0.001, "burst": 2,
         "match": {"domain": "r", "descriptor": [{"key": "user"}]}}])

    async def ask(target: str, hits: int | None) -> tuple[bool, float | None]:
        raw = RawRequest("", "", descriptor={"user": "u1"}, descriptor_target=target, hits=hits)
        d = (await e.check(raw))[1]
        v = next(v for v in d.verdicts if v.limiter == target)
        return d.allowed, v.remaining

    for target in ("per-user-day", "per-user-rate"):
        assert [await ask(target, 0) for _ in range(3)] == [(True, 2)] * 3, target
        assert [(await ask(target, None))[0] for _ in range(2)] == [True, True], target
        allowed, remaining = await ask(target, 0)
        assert allowed and remaining is not None and remaining < 1, target  # at the limit, not over
        assert (await ask(target, None))[0] is False, target
