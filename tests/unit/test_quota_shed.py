"""Shedders pushed to Envoy (``envoy_deny_all``, docs/rlqs.md "Shedders in Envoy"): a real
worker_utilization shedder driven by its sampler on an injected clock, and the quota book's
answers for its tier buckets at each report: DENY_ALL for a tier shed whole, ALLOW_ALL
otherwise, never DENY_ALL for critical traffic; a switch to shadow or off lifts it."""

from __future__ import annotations

import random
from pathlib import Path

from extauthz.control.switches import Mode, Switches
from extauthz.core.clock import ManualClock
from extauthz.engine.engine import Engine
from extauthz.engine.quota_service import (
    NOTHING,
    Action,
    QuotaBook,
    QuotaLimit,
    Share,
    StoreLedger,
    Usage,
    classification_id,
    envoy_sheds,
)
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.worker import sample_once
from extauthz.proto import ratelimit_strategy_pb2
from extauthz.server.services import quota_metrics, quota_response
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore

from .helpers import policy_from

#: 1 s before shedding, 3 s from nothing shed to all of it: test whole at 1/3 of the way,
#: get at 2/3, post at the end
WORKERS = {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
           "sample_interval": "1s", "good_below": 0.7, "bad_above": 0.8,
           "delay_before_shedding": "1s", "time_to_shed_all": "3s", "envoy_deny_all": True}
TIERS = ("test", "get", "post", "critical")


def _bucket(tier: str, shedder: str = "workers", rendered: str = "") -> dict[str, str]:
    return {"shedder": shedder, "tier": tier, "classification": rendered}


class Stack:
    """An engine holding the shedder, its store on the clock, and the quota book reading
    the shedder through :func:`envoy_sheds` as the server wires it (server/app.py)."""

    def __init__(self, tmp_path: Path, **overrides: object) -> None:
        self.clock = ManualClock()
        self.store = MemoryStore(self.clock)
        policy = policy_from(tmp_path, {"limiters": [dict(WORKERS, **overrides)]})
        self.engine = Engine(StoreGate(self.store, clock=self.clock), policy, rng=random.Random(0))
        limits: dict[str, QuotaLimit] = {}
        # the timelines report every second (sooner than Envoy: none coalesced here)
        self.book = QuotaBook(lambda: limits, clock=self.clock,
                              sheds=lambda: envoy_sheds(self.engine.snapshot.active), min_report_gap=0.0,
                              classification=lambda: classification_id(self.engine.snapshot.policy))
        self.stream = self.book.open("envoy")

    async def sample(self, utilization: float) -> float:
        (shedder,) = self.engine.snapshot.workers
        await self.store.set_value(shedder.signal_key, repr(utilization))
        return await sample_once(self.engine, shedder)

    def report(self, rendered: str | None = None) -> dict[str, str]:
        """Envoy's report of every tier's bucket (its matchers rendered from the policy's
        classification, or ``rendered``): each tier's answer (DENY_ALL/ALLOW_ALL)."""
        rendered = classification_id(self.engine.snapshot.policy) if rendered is None else rendered
        out = self.book.report(self.stream, "extauthz", [Usage(_bucket(t, rendered=rendered), 1, 1, 0)
                                                          for t in TIERS])
        answers = {}
        for action in out[self.stream.id]:
            assert action.share == NOTHING and action.ttl == self.book.ttl
            assert action.deny != action.allow
            answers[dict(action.bucket)["tier"]] = "DENY_ALL" if action.deny else "ALLOW_ALL"
        return answers


def _denied(answers: dict[str, str]) -> set[str]:
    return {t for t, rule in answers.items() if rule == "DENY_ALL"}


async def test_a_tier_shed_whole_is_denied_at_the_next_report_and_given_back(tmp_path: Path) -> None:
    s = Stack(tmp_path)
    assert _denied(s.report()) == set()
    # utilization bad: the ramp runs in the check (a tier partly shed stays ALLOW_ALL in
    # Envoy); a tier reaches Envoy as DENY_ALL once its drop probability is 1, and only at
    # the report after that (the book answers reports, it pushes nothing in between)
    seen: list[set[str]] = []
    for _ in range(6):
        s.clock.advance(1.0)
        level = await s.sample(1.0)
        (shedder,) = s.engine.snapshot.workers
        whole = {t.value for t, p in shedder.probabilities.items() if p >= 1.0}
        denied = _denied(s.report())
        assert denied == whole - {"critical"}, (level, denied, shedder.probabilities)
        seen.append(denied)
    assert seen[0] == set()  # delay_before_shedding: nothing yet
    assert {"test"} in seen and {"test", "get"} in seen  # whole tiers one by one, never critical
    assert [t for t in ("test", "get", "post") if any(t in d for d in seen)] == ["test", "get", "post"]
    order = [min(i for i, d in enumerate(seen) if t in d) for t in ("test", "get", "post")]
    assert order == sorted(order) and order[0] < order[2]
    assert seen[-1] == {"test", "get", "post"}  # everything but critical
    assert s.book.shed_denials == sum(len(d) for d in seen)
    # recovery: post comes back first (its probability falls below 1 first), test last
    back: list[set[str]] = []
    for _ in range(6):
        s.clock.advance(1.0)
        await s.sample(0.0)
        back.append(_denied(s.report()))
    assert back[-1] == set()
    assert [min(i for i, d in enumerate(back) if t not in d) for t in ("post", "get", "test")] == sorted(
        min(i for i, d in enumerate(back) if t not in d) for t in ("post", "get", "test"))


async def test_critical_is_never_denied_and_an_unknown_shedder_allows(tmp_path: Path) -> None:
    s = Stack(tmp_path)
    s.book.sheds = lambda: {"workers": frozenset(TIERS)}  # even if a shedder claimed it
    assert s.report() == {"test": "DENY_ALL", "get": "DENY_ALL", "post": "DENY_ALL", "critical": "ALLOW_ALL"}
    # a bucket of a shedder the policy in force does not push (removed by a reload): allowed
    out = s.book.report(s.stream, "", [Usage(_bucket("get", "gone"), 1, 1, 0)])
    (action,) = out[s.stream.id]
    assert action.allow and not action.deny


async def test_matchers_rendered_from_another_classification_are_never_denied(tmp_path: Path) -> None:
    """A reload that changes the classification (here a rule making /v1/payouts critical)
    leaves Envoy's matchers as they were rendered: their buckets (the old digest in their
    id) get ALLOW_ALL, for Envoy would refuse as post what the check now calls critical; an
    Envoy rendered from the policy in force gets DENY_ALL; a bucket id without the digest
    (a hand-written filter) is never denied."""
    s = Stack(tmp_path, delay_before_shedding="1s", time_to_shed_all="1s")
    for _ in range(4):
        s.clock.advance(1.0)
        await s.sample(1.0)
    before = classification_id(s.engine.snapshot.policy)
    assert _denied(s.report(before)) == {"test", "get", "post"}
    doc = {"classification": {"rules": [{"match": {"path_prefix": "/v1/payouts"}, "tier": "critical"}]},
           "limiters": [dict(WORKERS, delay_before_shedding="1s", time_to_shed_all="1s")]}
    s.engine.set_policy(policy_from(tmp_path, doc, name="reloaded.yaml"))
    after = classification_id(s.engine.snapshot.policy)
    assert after != before
    (shedder,) = s.engine.snapshot.workers
    assert {t.value for t in shedder.shed_whole()} == {"test", "get", "post"}  # still shedding
    assert _denied(s.report(before)) == set()
    assert _denied(s.report(after)) == {"test", "get", "post"}
    out = s.book.report(s.stream, "", [Usage({"shedder": "workers", "tier": "get"}, 1, 1, 0)])
    (action,) = out[s.stream.id]
    assert action.allow and not action.deny


async def test_a_switch_to_shadow_or_off_lifts_the_push(tmp_path: Path) -> None:
    s = Stack(tmp_path, delay_before_shedding="1s", time_to_shed_all="1s")
    for _ in range(4):
        s.clock.advance(1.0)
        await s.sample(1.0)
    assert _denied(s.report()) == {"test", "get", "post"}
    s.engine.set_switches(Switches(limiters={"workers": Mode.SHADOW}))
    assert _denied(s.report()) == set()
    s.engine.set_switches(Switches(global_mode=Mode.OFF))
    assert _denied(s.report()) == set()
    s.engine.set_switches(Switches())
    assert _denied(s.report()) == {"test", "get", "post"}


async def test_applies_to_tiers_bounds_what_is_pushed(tmp_path: Path) -> None:
    s = Stack(tmp_path, delay_before_shedding="1s", time_to_shed_all="1s", applies_to={"tiers": ["test"]})
    for _ in range(4):
        s.clock.advance(1.0)
        await s.sample(1.0)
    assert _denied(s.report()) == {"test"}


async def test_status_metrics_and_the_wire(tmp_path: Path) -> None:
    s = Stack(tmp_path, delay_before_shedding="1s", time_to_shed_all="1s")
    for _ in range(4):
        s.clock.advance(1.0)
        await s.sample(1.0)
    s.report()
    (stream,) = s.book.status()["streams"]  # type: ignore[misc]
    rules = {b["bucket"]["tier"]: (b["bucket"]["shedder"], b["rule"]) for b in stream["buckets"]}
    assert rules == {"test": ("workers", "DENY_ALL"), "get": ("workers", "DENY_ALL"),
                     "post": ("workers", "DENY_ALL"), "critical": ("workers", "ALLOW_ALL")}
    (denials,) = [m for m in quota_metrics(s.book) if m.name == "extauthz_quota_shed_denials"]
    assert denials.samples[0].value == 3
    # on the wire: blanket rules with the assignments' TTL (ALLOW_ALL is the enum's 0: present)
    bucket = tuple(sorted(_bucket("get").items()))
    wire = quota_response([Action(bucket, NOTHING, ttl=15.0, deny=True), Action(bucket, NOTHING, ttl=15.0, allow=True)])
    deny, allow = (a.quota_assignment_action for a in wire.bucket_action)
    assert deny.rate_limit_strategy.blanket_rule == ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL
    assert allow.rate_limit_strategy.HasField("blanket_rule")
    assert allow.rate_limit_strategy.blanket_rule == ratelimit_strategy_pb2.RateLimitStrategy.ALLOW_ALL
    assert allow.assignment_time_to_live.seconds == 15


def test_a_shedder_bucket_holds_no_tokens_beside_a_limiter(tmp_path: Path) -> None:
    """A limiter's bucket and a shedder's on one stream: the limiter is divided as before."""
    clock = ManualClock()
    limits = {"ip-rate": QuotaLimit(2, 4)}
    book = QuotaBook(lambda: limits, clock=clock, sheds=lambda: {"workers": frozenset({"get"})})
    stream = book.open("envoy")
    out = book.report(stream, "extauthz", [Usage({"limiter": "ip-rate", "source_ip": "10.0.0.1"}, 0, 0, 1),
                                           Usage(_bucket("get"), 0, 0, 1)])
    by_kind = {"limiter" if "limiter" in dict(a.bucket) else "shedder": a for a in out[stream.id]}
    assert by_kind["limiter"].share == Share(2, 4) and not by_kind["limiter"].deny
    assert by_kind["shedder"].deny and by_kind["shedder"].share == NOTHING


async def test_the_store_ledger_leaves_blanket_rules_as_they_are(tmp_path: Path) -> None:
    """With the store's ledger beneath the book (several replicas), a shedder's answers pass
    :meth:`QuotaBook.settle` unchanged and take no slice: ALLOW_ALL stays ALLOW_ALL (an
    empty share there would be DENY_ALL)."""
    clock = ManualClock()
    store = MemoryStore(clock)
    book = QuotaBook(dict, clock=clock, sheds=lambda: {"workers": frozenset({"get"})},
                     ledger=StoreLedger(store, Keys(), replica="r"))
    stream = book.open("envoy")
    out = book.report(stream, "extauthz", [Usage(_bucket(t), 1, 1, 0) for t in ("get", "post")])
    settled = await book.settle(out)
    assert {dict(a.bucket)["tier"]: (a.deny, a.allow) for a in settled[stream.id]} == {
        "get": (True, False), "post": (False, True)}
    assert book.ledger is not None and book.ledger.failures == 0
