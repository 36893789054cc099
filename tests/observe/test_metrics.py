"""Metrics scraped over HTTP from a running server, checked against known traffic; the
shipped alert rules parse and name only metrics the server exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Mode
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisSingle
from tests.conftest import ROOT

from .helpers import (
    FlakyStore,
    http,
    metrics_policy,
    rate,
    running,
    samples,
    scrape,
    shed_half,
    value,
    write_policy,
)


async def test_metrics_after_known_traffic(tmp_path: Path) -> None:
    clock = ManualClock()
    store = FlakyStore(clock)
    async with running([metrics_policy(tmp_path).parent], store=store, clock=clock) as (server, client):
        version = server.engine.snapshot.policy.version
        before = samples(await scrape(server))
        assert value(before, "extauthz_decisions_total", limiter="user-rate", tier="get", plan="",
                     outcome="denied") == 0

        # 5 GETs from one user: the bucket (3) admits 3 and refuses 2; the shadow bucket (1)
        # admits the first and would refuse the next 3 (they pass). The 5th is refused from
        # the refusal cache (limiters/refusals.py): no store call, so the other limiters
        # (the shadow bucket, the fleet) are not evaluated for it.
        assert [await client.check("sk_live_alice") for _ in range(5)] == [200, 200, 200, 429, 429]
        # The store fails once: every store-backed limiter fails open.
        store.fail = True
        assert await client.check("sk_live_bob") == 200
        store.fail = False
        # Shedding: the utilization signal reads 1.0: 10 s of delay, then 5 s of a 10 s ramp.
        await shed_half(server, store, clock)
        assert await client.check("sk_test_carol") == 503  # the test tier is shed first (p = 1)
        assert server.leases is not None
        await server.leases.sample_once()

        m = samples(await scrape(server))

        def decisions(limiter: str, outcome: str, tier: str = "get") -> float:
            return value(m, "extauthz_decisions_total", limiter=limiter, tier=tier, plan="", outcome=outcome)

        assert decisions("user-rate", "allowed") == 3
        assert decisions("user-rate", "denied") == 2
        assert decisions("user-rate", "failed_open") == 1
        assert decisions("dark", "allowed") == 1
        assert decisions("dark", "shadow_denied") == 3
        assert decisions("dark", "denied") == 0
        assert decisions("fleet", "allowed") == 4
        assert decisions("workers", "allowed") == 6
        assert decisions("workers", "denied", tier="test") == 1
        assert value(m, "extauthz_requests_total", tier="get", result="allowed") == 4
        assert value(m, "extauthz_requests_total", tier="get", result="rate_limited") == 2
        assert value(m, "extauthz_requests_total", tier="test", result="shed") == 1
        assert value(m, "extauthz_fail_open_total", reason="unavailable") == 1
        # 5 store calls (4 + the failed one): the cached refusal and the shed request never
        # reached the store.
        assert value(m, "extauthz_store_call_seconds_count") == 5
        assert value(m, "extauthz_store_call_seconds_bucket", le="+Inf") == 5
        assert value(m, "extauthz_shed_controller_level", limiter="workers") == 0.5
        assert value(m, "extauthz_shed_level", limiter="workers", tier="test") == 1.0
        assert value(m, "extauthz_shed_level", limiter="workers", tier="get") == 0.5
        assert value(m, "extauthz_shed_level", limiter="workers", tier="post") == 0.0
        assert value(m, "extauthz_shed_level", limiter="workers", tier="critical") == 0.0
        assert value(m, "extauthz_leases_in_flight", limiter="fleet") == 3  # 3 admitted, none released
        assert value(m, "extauthz_fleet_capacity", limiter="fleet") == 100
        assert value(m, "extauthz_shed_utilization", limiter="workers") == 1.0  # the signal read
        assert value(m, "extauthz_policy_info", version=version) == 1
        assert value(m, "extauthz_policy_reload_failures_total") == 0
        assert value(m, "extauthz_policy_reload_error") == 0
        assert value(m, "extauthz_limiter_mode", limiter="dark", mode="shadow") == 1
        assert value(m, "extauthz_limiter_mode", limiter="dark", mode="enforce") == 0
        assert value(m, "extauthz_access_log_entries_total") == 0
        assert value(m, "extauthz_lease_releases_total", path="access_log", outcome="released") == 0
        assert value(m, "extauthz_store_breaker_open") == 0

        # A kill switch shows up too.
        await server.control.set_switch("dark", None)
        await server.control.set_switch("*", Mode.OFF)
        m = samples(await scrape(server))
        assert value(m, "extauthz_switches_set", switch="*", mode="off") == 1
        assert value(m, "extauthz_limiter_mode", limiter="user-rate", mode="off") == 1



async def test_each_check_moves_its_limiter_outcome_and_its_doors_latency_histogram(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    async with running([policy.parent], http_listen="127.0.0.1:0") as (server, client):
        url = f"http://127.0.0.1:{server.http_port}/v1/customers"

        def moved(before: dict[Any, float], after: dict[Any, float]) -> dict[tuple[str, ...], float]:
            """What changed: limiter outcomes and (door, decision) histogram counts."""
            out: dict[tuple[str, ...], float] = {}
            for (name, pairs), v in after.items():
                labels = dict(pairs)
                if name == "extauthz_limiter_decisions_total":
                    key: tuple[str, ...] = (labels["limiter"], labels["outcome"])
                elif name == "extauthz_check_duration_seconds_count":
                    key = (labels["door"], labels["decision"])
                else:
                    continue
                if v != before.get((name, pairs), 0):
                    out[key] = v - before.get((name, pairs), 0)
            return out

        m0 = samples(await scrape(server))
        # every limiter x outcome and door x decision is exported from the start (at 0)
        assert value(m0, "extauthz_limiter_decisions_total", limiter="user-rate", outcome="denied") == 0
        assert value(m0, "extauthz_check_duration_seconds_count", door="http", decision="shed") == 0
        assert await client.check("sk_live_alice") == 200  # the gRPC door: the bucket's one token
        m1 = samples(await scrape(server))
        assert moved(m0, m1) == {("user-rate", "allowed"): 1, ("grpc", "allowed"): 1}
        assert (await http("GET", url, headers={"x-api-key": "sk_live_alice"}))[0] == 429  # the HTTP door
        m2 = samples(await scrape(server))
        assert moved(m1, m2) == {("user-rate", "denied"): 1, ("http", "rate_limited"): 1}
    # a histogram: cumulative buckets from 100 us to 1 s, +Inf equal to the count, a time summed
    grpc_allowed = {"door": "grpc", "decision": "allowed"}
    bounds = sorted(float(dict(pairs)["le"]) for (name, pairs) in m2
                    if name == "extauthz_check_duration_seconds_bucket" and grpc_allowed.items() <= dict(pairs).items())
    assert bounds[0] == 0.0001 and bounds[-2] == 1.0 and bounds[-1] == float("inf")
    assert value(m2, "extauthz_check_duration_seconds_bucket", **grpc_allowed, le="+Inf") == 1
    assert value(m2, "extauthz_check_duration_seconds_sum", **grpc_allowed) > 0


@pytest.mark.redis
async def test_redis_store_round_trips_and_script_calls_are_exported(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    store = RedisStore.from_url(redis_single_clean.url, deadline=2.0)
    policy = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=10)])
    async with running([policy.parent], store=store, store_deadline_ms=2000) as (server, client):
        before = samples(await scrape(server))
        assert [await client.check(f"sk_live_{i}") for i in range(3)] == [200] * 3
        m = samples(await scrape(server))
        trips = value(m, "extauthz_store_round_trips_total")
        calls = value(m, "extauthz_store_script_calls_total")
        # the store's own counters, and one script call (and round trip) per check
        assert (trips, calls) == (store.stats.round_trips, store.stats.commands)
        assert calls - value(before, "extauthz_store_script_calls_total") == 3
        assert trips - value(before, "extauthz_store_round_trips_total") == 3


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "docs" / "alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
    covered = " ".join(r["expr"] for r in rules)
    for needed in ("extauthz_fail_open_total", "extauthz_shed_level", "extauthz_policy_reload_failures_total",
                   'outcome="denied"', "extauthz_quota_overadmission_total"):
        assert needed in covered


async def test_alert_rules_name_only_exported_metrics(tmp_path: Path) -> None:
    batched = {"name": "batched", "type": "request_rate", "rate": 10, "burst": 10, "consistency": "batched"}
    # a bound of one key per limiter: the second key is an eviction (ExtauthzStoreEvicting)
    async with running([metrics_policy(tmp_path, batched).parent], memory_max_keys=1) as (server, client):
        await client.check("sk_live_x")
        await client.check("sk_live_y")
        await server.control.set_switch("dark", Mode.OFF)
        exported = set()
        for (name, _labels) in samples(await scrape(server)):
            exported.add(name)
    for rule in alert_rules():
        for metric in re.findall(r"\bextauthz_[a-z_]+", rule["expr"]):
            assert metric in exported, f"{rule['alert']}: {metric} is not exported"


async def test_allowed_counts_a_limiters_own_verdict_even_when_another_refused(tmp_path: Path) -> None:
    """docs/operations.md's meaning of ``extauthz_limiter_decisions_total``: ``allowed`` is the
    limiter's own rule letting the request through, whether or not another limiter refused it
    (nothing is committed then): the share refused is of the requests the limiter saw. A
    request refused before the store call (tight's refusal cache) counts for no other limiter."""
    policy = write_policy(tmp_path / "p" / "api.yaml", [rate("roomy", burst=100), rate("tight", burst=1)])
    async with running([policy.parent]) as (server, client):
        assert [await client.check("sk_live_bob") for _ in range(3)] == [200, 429, 429]
        m = samples(await scrape(server))
        assert value(m, "extauthz_limiter_decisions_total", limiter="tight", outcome="denied") == 2
        # 1: admitted; 2: tight refused in the store call, roomy's rule allowed (nothing taken);
        # 3: tight refused from its refusal cache before any store call: roomy saw nothing
        assert value(m, "extauthz_limiter_decisions_total", limiter="roomy", outcome="allowed") == 2
        assert value(m, "extauthz_requests_total", tier="get", result="allowed") == 1
