"""Rate limit descriptors in the policy: which limiter a descriptor reaches (the most
specific match, entry by entry, as envoyproxy/ratelimit's ``GetLimit`` walks its config
tree), ``replaces`` and ``unlimited`` across a request's descriptors, and the counter per
descriptor value (the limiter's key)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.observe.metrics import Metrics
from extauthz.policy.classify import Classifier
from extauthz.policy.descriptors import Entries, entries_of
from extauthz.policy.model import Policy
from testinfra.probes import resolve

from .helpers import engine_for, policy_from


def quota(name: str, domain: str, *entries: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "quota", "limit": 10, "period": "second",
            "match": {"domain": domain, "descriptor": list(entries)}, **extra}


def names(policy: Policy, domain: str, *descriptors: dict[str, str]) -> list[str | None]:
    found = resolve(policy.descriptors, domain, [entries_of(d) for d in descriptors])
    return [None if t is None else ("unlimited" if t.unlimited else t.name) for t in found]


def test_a_value_of_its_own_wins_over_the_default_of_its_key(tmp_path: Path) -> None:
    # envoyproxy/ratelimit README: per-IP limits, one address with a limit of its own
    p = policy_from(tmp_path, {"limiters": [
        quota("per-ip", "edge_proxy_per_ip", {"key": "remote_address"}),
        quota("one-ip", "edge_proxy_per_ip", {"key": "remote_address", "value": "50.0.0.5"}),
    ]})
    assert names(p, "edge_proxy_per_ip", {"remote_address": "50.0.0.5"}, {"remote_address": "50.0.0.6"}) == [
        "one-ip", "per-ip"]
    assert names(p, "other_domain", {"remote_address": "50.0.0.5"}) == [None]  # domain mismatch
    assert names(p, "edge_proxy_per_ip", {"destination_cluster": "x"}) == [None]  # unknown descriptor


def test_nested_descriptors_match_only_at_their_depth(tmp_path: Path) -> None:
    # envoyproxy/ratelimit README: marketing messages to one number: 5 a day; any message: 100
    p = policy_from(tmp_path, {"limiters": [
        quota("marketing", "messaging", {"key": "message_type", "value": "marketing"}, {"key": "to_number"}),
        quota("any", "messaging", {"key": "to_number"}),
    ]})
    d = "messaging"
    assert names(p, d, {"message_type": "marketing", "to_number": "2061111111"}) == ["marketing"]
    assert names(p, d, {"to_number": "2061111111"}) == ["any"]
    assert names(p, d, {"message_type": "transactional", "to_number": "2061111111"}) == [None]
    assert names(p, d, {"message_type": "marketing"}) == [None]  # the node has no limit of its own
    assert names(p, d, {"to_number": "1", "extra": "x"}) == [None]  # more entries than the config has


def test_the_walk_is_greedy_a_specific_value_never_falls_back_to_the_default(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        quota("a-default", "d", {"key": "a"}, {"key": "b"}),
        quota("a-x-c", "d", {"key": "a", "value": "x"}, {"key": "c"}),
    ]})
    assert names(p, "d", {"a": "y", "b": "1"}) == ["a-default"]
    # a=x has a node of its own: b is looked up under it (only c is there), not under a's default
    assert names(p, "d", {"a": "x", "b": "1"}) == [None]
    assert names(p, "d", {"a": "x", "c": "1"}) == ["a-x-c"]


def test_a_value_prefix_matches_after_the_exact_value(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        quota("foo-paths", "edge", {"key": "path", "value": "/foo*"}),
        quota("foo-bar", "edge", {"key": "path", "value": "/foo/bar"}),
        quota("paths", "edge", {"key": "path"}),
    ]})
    assert names(p, "edge", {"path": "/foo/bar"}, {"path": "/foo/baz"}, {"path": "/fo"}, {"path": "/foo"}) == [
        "foo-bar", "foo-paths", "paths", "foo-paths"]


def test_replaces_and_unlimited_across_the_requests_descriptors(tmp_path: Path) -> None:
    # envoyproxy/ratelimit: a limit whose name another matched limit replaces is not applied;
    # an unlimited descriptor is answered OK and can replace too
    p = policy_from(tmp_path, {
        "limiters": [
            quota("per-key", "d", {"key": "key"}),
            quota("per-sub", "d", {"key": "key", "value": "value"}, {"key": "subkey"}, replaces=["per-key"]),
            quota("per-route", "d", {"key": "route"}),
        ],
        "unlimited": [{"name": "internal", "replaces": ["per-route"],
                       "match": {"domain": "d", "descriptor": [{"key": "route", "value": "health"}]}}],
    })
    assert names(p, "d", {"key": "k"}, {"route": "api"}) == ["per-key", "per-route"]
    assert names(p, "d", {"key": "k"}, {"key": "value", "subkey": "s"}) == [None, "per-sub"]
    assert names(p, "d", {"key": "value"}) == [None]  # key=value has a node of its own (greedy)
    # the unlimited descriptor keeps its place and replaces per-route in the other descriptor
    assert names(p, "d", {"route": "health"}, {"route": "api"}, {"key": "k"}) == ["unlimited", None, "per-key"]


def test_the_counter_is_per_descriptor_value(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        quota("per-ip-path", "edge", {"key": "remote_address"}, {"key": "path"}),
        {**quota("per-key", "api", {"key": "plan"}, {"key": "api_key"}), "key": [{"descriptor": "api_key"}]},
    ]})
    c = Classifier(p, salt=b"salt")

    def keys(**descriptor: str) -> tuple[tuple[str, bool], ...]:
        return c.context(RawRequest("", "", descriptor=descriptor)).keys

    one = keys(remote_address="10.0.0.1", path="/a")
    assert one == keys(remote_address="10.0.0.1", path="/a")
    assert one[0] != keys(remote_address="10.0.0.1", path="/b")[0]
    assert one[0] != keys(remote_address="10.0.0.2", path="/a")[0]
    # a key of its own: the plan entry matched but not counted per
    assert keys(plan="free", api_key="k1")[1] == keys(plan="pro", api_key="k1")[1]
    assert keys(plan="free", api_key="k1")[1] != keys(plan="free", api_key="k2")[1]
    assert not keys(plan="free", api_key="k1")[1][1]  # present


def test_the_table_survives_pickling_and_compares_by_content(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [quota("per-ip", "edge", {"key": "remote_address"})]})
    copy = pickle.loads(pickle.dumps(p))
    assert copy.descriptors == p.descriptors and copy == p
    assert names(copy, "edge", {"remote_address": "1"}) == ["per-ip"]


@pytest.mark.parametrize("entries", [(), (("a", "1"), ("a", "1"))])
def test_odd_descriptors_reach_nothing(tmp_path: Path, entries: Entries) -> None:
    p = policy_from(tmp_path, {"limiters": [quota("per-a", "d", {"key": "a"})]})
    assert p.descriptors.lookup("d", entries) is None


async def test_a_limiter_with_match_counts_only_the_descriptors_that_reach_it(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        {**quota("per-ip", "edge", {"key": "remote_address"}), "limit": 2},
        {**quota("per-ip-shadow", "edge", {"key": "remote_address", "value": "10.0.0.9"}), "limit": 1,
         "mode": "shadow"},
        {"name": "per-user", "type": "request_rate", "rate": 1, "burst": 1},
    ]})
    clock = ManualClock(1_800_000_000.25)
    metrics = Metrics()
    engine, _ = engine_for(p, clock, observer=metrics)
    c = Classifier(p, salt=b"salt")

    async def descriptor(domain: str, **entries: str) -> tuple[bool, list[str]]:
        target = p.descriptors.lookup(domain, entries_of(entries))
        if target is None:  # no limiter: the door answers OK without the engine
            return True, []
        raw = RawRequest("", "", descriptor=entries, descriptor_target=target.name)
        d = await engine.decide(c.context(raw))
        return d.allowed, [v.limiter for v in d.verdicts]

    # a checked request: the limiters with match do not apply (and are not counted as skipped)
    d = await engine.decide(c.context(RawRequest("GET", "/x", headers={"x-api-key": "k"})))
    assert [v.limiter for v in d.verdicts] == ["per-user"] and d.skipped == ()
    assert [await descriptor("edge", remote_address="10.0.0.1") for _ in range(3)] == [
        (True, ["per-ip"]), (True, ["per-ip"]), (False, ["per-ip"])]
    assert await descriptor("edge", remote_address="10.0.0.2") == (True, ["per-ip"])  # its own counter
    # shadow: counted, never refused
    assert [await descriptor("edge", remote_address="10.0.0.9") for _ in range(2)] == [
        (True, ["per-ip-shadow"]), (True, ["per-ip-shadow"])]
    assert metrics.registry.get_sample_value("extauthz_limiter_decisions_total", {
        "limiter": "per-ip-shadow", "outcome": "shadow_denied"}) == 1  # counted as would-refuse
    assert await descriptor("other", remote_address="10.0.0.1") == (True, [])  # domain mismatch
    clock.advance(1.0)  # the next second: a new window
    assert await descriptor("edge", remote_address="10.0.0.1") == (True, ["per-ip"])


def shedder(domain: str, *entries: dict[str, str]) -> dict[str, Any]:
    return {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
            "match": {"domain": domain, "descriptor": list(entries)}}


@pytest.mark.parametrize(("classification", "entries", "tier"), [
    ({}, {"tier": "critical"}, "critical"),
    ({}, {"tier": "GET "}, "get"),
    ({}, {"tier": "nonsense"}, "post"),  # an unknown tier is never trusted (counted)
    ({}, {"api_key": "k"}, "post"),  # no tier entry: post, as before
    ({"descriptor_key": "class"}, {"class": "test"}, "test"),
    ({"descriptor_key": "class"}, {"tier": "critical"}, "post"),
])
def test_a_descriptor_names_its_tier_in_the_entry_the_policy_says(
        tmp_path: Path, classification: dict[str, str], entries: dict[str, str], tier: str) -> None:
    p = policy_from(tmp_path, {"classification": classification, "limiters": [quota("q", "edge", {"key": "a"})]})
    ctx = Classifier(p, salt=b"salt").context(RawRequest("", "", descriptor=entries, descriptor_target="q"))
    assert (ctx.tier.value, ctx.tier_source) == (tier, "descriptor" if tier != "post" else "default")


async def test_worker_utilization_sheds_descriptors_by_their_tier_never_critical(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        shedder("edge", {"key": "tier"}),
        {"name": "per-user", "type": "request_rate", "rate": 100, "burst": 100},
    ]})
    assert p.key_index == {}  # fleet-wide: no key of its own
    engine, _ = engine_for(p, ManualClock(1_800_000_000.0))
    c = Classifier(p, salt=b"salt")
    (worker,) = engine.snapshot.workers
    worker.set_level(1.0)  # shed everything sheddable

    async def shed(**entries: str) -> tuple[bool, list[str]]:
        target = p.descriptors.lookup("edge", entries_of(entries))
        assert target is not None and target.name == "workers"
        d = await engine.decide(c.context(RawRequest("", "", descriptor=entries, descriptor_target=target.name)))
        return d.allowed, [v.limiter for v in d.verdicts]

    assert await shed(tier="critical") == (True, ["workers"])
    for tier in ("post", "get", "test"):
        assert await shed(tier=tier) == (False, ["workers"])
    # a checked request: the shedder with match does not apply to it
    d = await engine.decide(c.context(RawRequest("POST", "/x", headers={"x-api-key": "k"})))
    assert d.allowed and [v.limiter for v in d.verdicts] == ["per-user"]
    worker.set_level(0.0)
    assert await shed(tier="post") == (True, ["workers"])


@pytest.mark.parametrize("spec", [
    {**shedder("edge", {"key": "tier"}), "applies_to": {"tiers": ["get"]}},
    {"name": "fleet", "type": "fleet_usage", "capacity": 10, "applies_to": {"tiers": ["get"]},
     "match": {"domain": "e", "descriptor": [{"key": "tier"}]}},
])
def test_fleet_wide_limiters_with_match_take_no_applies_to(tmp_path: Path, spec: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="'applies_to' does not apply with 'match'"):
        policy_from(tmp_path, {"limiters": [spec]})


async def test_a_huge_hits_addend_is_over_the_largest_limit(tmp_path: Path) -> None:
    from google.protobuf import wrappers_pb2

    from extauthz.policy.schema import MAX_COUNT
    from extauthz.proto import ratelimit_common_pb2, rls_pb2
    from extauthz.server.rls import hits_of

    p = policy_from(tmp_path, {"limiters": [
        {**quota("big", "edge", {"key": "k"}), "limit": MAX_COUNT, "period": "year"},
        {"name": "big-rate", "type": "request_rate", "rate": 1000, "burst": MAX_COUNT,
         "match": {"domain": "rate", "descriptor": [{"key": "k"}]}}]})
    engine, _ = engine_for(p, ManualClock(1_800_000_000.0))
    c = Classifier(p, salt=b"salt")
    d = ratelimit_common_pb2.RateLimitDescriptor(hits_addend=wrappers_pb2.UInt64Value(value=2**64 - 1))
    for request, descriptor in ((rls_pb2.RateLimitRequest(hits_addend=2**32 - 1), d.__class__()),
                                (rls_pb2.RateLimitRequest(), d)):
        hits = hits_of(request, descriptor)
        assert hits is not None and hits > MAX_COUNT
        for target in ("big", "big-rate"):
            raw = RawRequest("", "", descriptor={"k": "v"}, descriptor_target=target, hits=hits)
            assert not (await engine.decide(c.context(raw))).allowed, (target, hits)
    assert hits_of(rls_pb2.RateLimitRequest(hits_addend=3), d.__class__()) == 3


def test_a_descriptors_values_are_not_in_its_repr() -> None:
    from extauthz.server.rls import DescriptorCall

    call = DescriptorCall({"api_key": "sk_live_secret"}, "per-key", None)
    assert "sk_live_secret" not in repr(call)
    assert "sk_live_secret" not in repr(RawRequest("", "", descriptor=call.entries, descriptor_target="per-key"))


def test_a_key_holding_the_tables_separator_reaches_no_value_of_its_own(tmp_path: Path) -> None:
    # the table files key "path" with value "/admin" under "path\0/admin": a request entry whose
    # key is that string (any value) must not reach it by the key's default
    p = policy_from(tmp_path, {"limiters": [
        quota("admin", "d", {"key": "path", "value": "/admin"}),
        quota("admin-prefix", "e", {"key": "path", "value": "/admin*"})]})
    assert p.descriptors.lookup("d", (("path\0/admin", "x"),)) is None
    assert p.descriptors.lookup("e", (("path\0/admin", "x"),)) is None
    assert p.descriptors.lookup("d", (("path", "/admin"),)) is not None
