"""The rate limit quota service's division and book (extauthz/engine/quota_service.py), on an
injected clock: shares follow demand, never sum past the limit in the ledger, a shrink is
confirmed by a report before another share grows, idle buckets are abandoned, bounds hold."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import (
    NOTHING,
    Action,
    QuotaBook,
    QuotaError,
    QuotaLimit,
    Share,
    StoreLedger,
    Usage,
    divide,
    limits_of,
    shown,
)
from extauthz.limiters import build_limiters
from extauthz.policy import load_policy
from extauthz.policy.classify import valid_hash
from extauthz.store.base import CheckResult, Op
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore

BUCKET = {"limiter": "per-ip", "ip": "10.0.0.1"}
BUCKET_KEY = tuple(sorted(BUCKET.items()))


def test_divide_follows_demand_in_whole_tokens() -> None:
    shares = divide(Share(10, 20), {"a": 9.0, "b": 1.0}, {})
    assert sum(s.fill for s in shares.values()) == 10
    assert sum(s.burst for s in shares.values()) == 20
    assert shares["a"].fill > shares["b"].fill > 0  # the quiet stream keeps a share


def test_divide_equal_without_demand_and_empty() -> None:
    assert divide(Share(4, 4), {"a": 0.0, "b": 0.0}, {}) == {"a": Share(2, 2), "b": Share(2, 2)}
    assert divide(Share(4, 4), {}, {}) == {}


def test_divide_grows_only_into_what_no_stream_holds() -> None:
    # b holds everything; a's demand rises: b shrinks at once, a gets only what is free (0)
    shares = divide(Share(10, 10), {"a": 9.0, "b": 1.0}, {"a": NOTHING, "b": Share(10, 10)})
    assert shares["a"] == NOTHING
    assert shares["b"].fill < 10
    # once b's shrink is confirmed (the ledger holds b's new share), a grows
    confirmed = {"a": NOTHING, "b": shares["b"]}
    grown = divide(Share(10, 10), {"a": 9.0, "b": 1.0}, confirmed)
    assert grown["a"].fill == 10 - shares["b"].fill


def test_divide_never_sums_past_the_limit_random() -> None:
    rnd = random.Random(33)
    for _ in range(500):
        limit = Share(rnd.randint(0, 50), rnd.randint(0, 50))
        n = rnd.randint(1, 6)
        held: dict[int, Share] = {}
        left = limit
        for k in range(n):  # a ledger within the limit
            s = Share(rnd.randint(0, left.fill), rnd.randint(0, left.burst))
            held[k] = s
            left = Share(left.fill - s.fill, left.burst - s.burst)
        demand = {k: rnd.choice([0.0, rnd.random() * 100]) for k in range(n)}
        shares = divide(limit, demand, held)
        # the ledger after: each holds the larger of its old hold and its new share
        assert sum(max(held[k].fill, shares[k].fill) for k in range(n)) <= limit.fill
        assert sum(max(held[k].burst, shares[k].burst) for k in range(n)) <= limit.burst


def test_divide_lowered_limit_only_shrinks() -> None:
    shares = divide(Share(4, 4), {"a": 1.0, "b": 1.0}, {"a": Share(5, 5), "b": Share(5, 5)})
    assert all(s.fill <= 5 and s.burst <= 5 for s in shares.values())
    assert sum(s.fill for s in shares.values()) <= 4


def test_quota_limit_interval_in_whole_seconds() -> None:
    assert QuotaLimit(10, 20).interval == 1 and QuotaLimit(10, 20).total == Share(10, 20)
    assert QuotaLimit(0.5, 3).interval == 2 and QuotaLimit(0.5, 3).total == Share(1, 3)
    assert QuotaLimit(0.4, 1).interval == 3 and QuotaLimit(0.4, 1).total.fill == 1
    with pytest.raises(ValueError):
        QuotaLimit(float("nan"), 1)


def _ledger(book: QuotaBook) -> Share:
    fill = burst = 0
    for s in book.streams.values():
        for h in s.buckets.values():
            fill += max(h.ledger.fill, h.share.fill)
            burst += max(h.ledger.burst, h.share.burst)
    return Share(fill, burst)


def _within(a: Share, b: Share) -> bool:
    return a.fill <= b.fill and a.burst <= b.burst


def _book(clock: ManualClock, rate: float = 10, burst: float = 10, min_report_gap: float = 0.0) -> QuotaBook:
    """A book; its timelines report faster than Envoy does (``min_report_gap`` 0: none
    coalesced) unless a test says otherwise."""
    limits = {"per-ip": QuotaLimit(rate, burst)}
    return QuotaBook(lambda: limits, clock=clock, min_report_gap=min_report_gap)


def _shares(actions: list[Action]) -> dict[tuple[tuple[str, str], ...], Share | None]:
    return {a.bucket: a.share for a in actions}


def test_first_report_assigns_and_a_second_stream_waits_for_the_confirmed_shrink() -> None:
    clock = ManualClock()
    book = _book(clock)
    a, b = book.open("a"), book.open("b")
    out = book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    (act,) = out[a.id]
    assert act.share == Share(10, 10) and act.interval == 1 and act.ttl == 15.0
    # b subscribes: a shrinks at once (pushed to a), b gets nothing yet (a's hold is unconfirmed)
    out = book.report(b, "edge", [Usage(BUCKET, 0, 0, 0)])
    assert out[b.id][0].share == NOTHING
    assert out[a.id][0].share == Share(5, 5)
    # both report every 5 s (a 5/s, b 2/s): b's share grows once a's shrink is confirmed,
    # and the ledger (each stream's larger of share and unconfirmed hold) never passes 10
    for _ in range(4):
        clock.advance(5)
        book.report(b, "", [Usage(BUCKET, 5, 0, 10)])
        assert _within(_ledger(book), Share(10, 10))
        book.report(a, "", [Usage(BUCKET, 5, 25, 0)])
        assert _within(_ledger(book), Share(10, 10))
    held_b = b.buckets[tuple(sorted(BUCKET.items()))].share
    held_a = a.buckets[tuple(sorted(BUCKET.items()))].share
    assert held_a.fill > held_b.fill > 0
    assert held_a.fill + held_b.fill == 10
    assert book.overadmission == 0
    status = book.status()
    assert [len(s["buckets"]) for s in status["streams"]] == [1, 1]  # type: ignore[index, arg-type]


def test_a_report_past_its_share_counts_one_entry_never_its_requests() -> None:
    """Self-reported usage proves nothing: an entry allowing more than its share could counts
    once in reported_excess, however many requests it claims; over-admission counts only what
    the ledger proves, and stays 0."""
    clock = ManualClock()
    book = _book(clock, rate=2, burst=4, min_report_gap=2.5)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    clock.advance(5)
    # the share over the elapsed time, rounded down by Envoy (up to 1 s more), and the burst
    book.report(a, "", [Usage(BUCKET, 5, 2 * (5 + 1) + 4, 0)])
    assert book.reported_excess == 0
    clock.advance(5)
    book.report(a, "", [Usage(BUCKET, 5, 2 * (5 + 1) + 4 + 3, 0)])
    assert book.reported_excess == 1
    clock.advance(5)
    book.report(a, "", [Usage(BUCKET, 5, 10**15, 0)])  # a peer inflating: taken up to 10^12, one entry
    assert book.reported_excess == 2
    # entries sooner than Envoy reports are coalesced: audited once, with the next one settled
    for _ in range(20):  # 2 s: within half a report interval of the last entry settled
        clock.advance(0.1)
        assert book.report(a, "", [Usage(BUCKET, 0, 10**6, 0)]) == {}
    assert book.coalesced == 20 and book.reported_excess == 2
    clock.advance(5)
    book.report(a, "", [Usage(BUCKET, 5, 0, 0)])
    assert book.reported_excess == 3
    assert book.overadmission == 0
    status = book.status()
    assert (status["overadmission"], status["reported_excess"], status["coalesced"]) == (0, 3, 20)


def test_a_coalesced_entry_s_requests_count_in_the_next_settled_entry_s_demand() -> None:
    """A stream reporting every 2 s whose requests all fall in the entries coalesced (sooner
    than 2.5 s after the last settled one): the entries settled carry none of their own, but
    the coalesced ones' are added to them, so the bucket has a demand and is never abandoned
    as idle (six settled entries without a request would abandon it)."""
    clock = ManualClock()
    book = _book(clock, min_report_gap=2.5)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    for n in range(1, 21):
        clock.advance(2)
        out = book.report(a, "", [Usage(BUCKET, 2, 30, 10) if n % 2 else Usage(BUCKET, 2, 0, 0)])
        assert all(action.share is not None for action in out.get(a.id, [])), n  # never abandoned
    assert book.coalesced == 10
    (bucket,) = book.status()["streams"][0]["buckets"]  # type: ignore[index]
    assert bucket["demand"] == 10.0  # 40 requests in each settled entry's 4 s
    assert (bucket["allowed"], bucket["denied"]) == (300, 100)  # each counted once


def test_a_stream_flooding_reports_costs_no_store_calls_and_another_is_served() -> None:
    """One stream sends 2,000 reports of 20 buckets in 10 s (Envoy sends 2): its buckets are
    settled on their first entry and at most once per half report interval after, so the
    store sees a handful of calls; another stream reporting at Envoy's pace gets its
    assignments."""
    clock = ManualClock()
    store = _CountingStore(clock)
    book = QuotaBook(lambda: {"per-ip": QuotaLimit(10, 20)}, clock=clock,
                     ledger=StoreLedger(store, Keys(), replica="r"))
    flood, calm = book.open("flood"), book.open("calm")
    buckets = [{"limiter": "per-ip", "ip": f"10.0.1.{n}"} for n in range(20)]

    async def run() -> int:
        served = 0
        for n in range(2000):
            clock.advance(0.005)
            await book.settle(book.report(flood, "edge", [Usage(b, 0 if n == 0 else 1, 5, 5) for b in buckets]))
            if n % 1000 == 999:  # the calm stream at Envoy's pace (every 5 s)
                out = await book.settle(book.report(calm, "edge", [Usage(BUCKET, 0 if n < 1000 else 5, 0, 1)]))
                served += len(out.get(calm.id, []))
        return served

    served = asyncio.run(run())
    assert served == 2  # each calm report answered
    # a bucket settled at most once per 2.5 s: the flood's first report and 4 more in 10 s,
    # one store call each (a report's holds in one call), and the calm stream's 2
    assert store.calls <= 5 + 2, store.calls
    assert book.coalesced >= 2000 * 20 - 20 * 5
    assert book.overadmission == 0


class _CountingStore(MemoryStore):
    """The embedded store, counting its check calls."""

    calls = 0

    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        self.calls += 1
        return await super().check(ops, lease_id)


def test_idle_bucket_abandoned_and_its_share_freed() -> None:
    clock = ManualClock()
    book = _book(clock)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    for _ in range(5):
        clock.advance(5)
        out = book.report(a, "", [Usage(BUCKET, 5, 0, 0)])
        assert _shares(out[a.id]) != {tuple(sorted(BUCKET.items())): None}
    clock.advance(5)
    out = book.report(a, "", [Usage(BUCKET, 5, 0, 0)])
    assert _shares(out[a.id]) == {tuple(sorted(BUCKET.items())): None}  # abandoned
    # a's Envoy enforces its last assignment until the abandon reaches it: held until the TTL
    assert _ledger(book) == Share(10, 10)
    clock.advance(book.ttl)
    book.report(book.open("b"), "edge", [])
    assert not a.buckets and BUCKET_KEY not in book.holders


def test_an_abandoned_share_is_held_until_envoy_surely_dropped_it() -> None:
    # a goes idle and is abandoned while b is busy: b does not grow into a's last share at
    # once (a's Envoy keeps enforcing it until the abandon reaches it, or its TTL passes)
    clock = ManualClock()
    book = _book(clock, rate=100, burst=100)
    a, b = book.open("a"), book.open("b")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    book.report(b, "edge", [Usage(BUCKET, 0, 0, 0)])
    last_a = NOTHING
    for _ in range(6):
        clock.advance(5)
        out = book.report(a, "", [Usage(BUCKET, 5, 0, 0)])
        if a.id in out and out[a.id][0].share is not None:
            last_a = out[a.id][0].share
        book.report(b, "", [Usage(BUCKET, 5, 500, 200)])
    assert a.buckets[BUCKET_KEY].abandoned and last_a.fill > 0 and last_a.burst > 0
    clock.advance(1)
    out = book.report(b, "", [Usage(BUCKET, 1, 100, 40)])
    share_b = b.buckets[BUCKET_KEY].share
    assert share_b.fill + last_a.fill <= 100 and share_b.burst + last_a.burst <= 100
    for _ in range(4):  # after the TTL a's hold is gone: b takes the whole limit
        clock.advance(5)
        book.report(b, "", [Usage(BUCKET, 5, 500, 200)])
    assert b.buckets[BUCKET_KEY].share == Share(100, 100) and BUCKET_KEY not in a.buckets


def test_an_abandoned_bucket_reported_again_is_served_again() -> None:
    clock = ManualClock()
    book = _book(clock)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    for _ in range(6):
        clock.advance(5)
        out = book.report(a, "", [Usage(BUCKET, 5, 0, 0)])
    assert out[a.id][0].share is None and a.buckets[BUCKET_KEY].abandoned
    clock.advance(1)  # a new request: Envoy reports the bucket anew
    out = book.report(a, "", [Usage(BUCKET, 0, 0, 1)])
    assert out[a.id][0].share == Share(10, 10) and not a.buckets[BUCKET_KEY].abandoned
    clock.advance(book.ttl)
    book.report(a, "", [Usage(BUCKET, 5, 3, 0)])
    assert BUCKET_KEY in a.buckets and book.holders[BUCKET_KEY] == {a.id}


def test_a_closed_stream_gives_its_shares_back_after_the_ttl() -> None:
    clock = ManualClock()
    book = _book(clock)
    a, b = book.open("a"), book.open("b")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    book.close(a)
    # a's Envoy enforces its assignment until the TTL: its share is still held
    out = book.report(b, "edge", [Usage(BUCKET, 0, 0, 0)])
    assert out[b.id][0].share == NOTHING
    assert book.status()["streams"][0]["closed"] is True  # type: ignore[index]
    clock.advance(book.ttl)
    out = book.report(b, "", [Usage(BUCKET, 15, 0, 3)])
    # a's 10 tokens go back, but a's Envoy may have spent them: they cool while the unheld
    # fill (10 a second) refills them, 1 s, before b's new bucket starts full
    assert out[b.id][0].share == NOTHING and book.cooling[BUCKET_KEY][0] == 10
    assert list(book.streams) == [b.id]
    clock.advance(0.9)
    assert book.report(b, "", [Usage(BUCKET, 0, 0, 3)])[b.id][0].share == NOTHING
    clock.advance(0.1)
    assert book.report(b, "", [Usage(BUCKET, 1, 0, 3)])[b.id][0].share == Share(10, 10)
    assert book.cooling[BUCKET_KEY][0] == 0


def test_unknown_limiter_is_denied_never_allowed() -> None:
    book = _book(ManualClock())
    a = book.open("a")
    (act,) = book.report(a, "edge", [Usage({"limiter": "gone"}, 0, 0, 0)])[a.id]
    assert act.deny


def test_bounds() -> None:
    clock = ManualClock()
    book = QuotaBook(lambda: {}, clock=clock, max_streams=1, max_buckets=2)
    a = book.open("a")
    with pytest.raises(QuotaError, match="quota streams are open"):
        book.open("b")
    with pytest.raises(QuotaError, match="at most 2 buckets"):
        book.report(a, "edge", [Usage({"limiter": str(i)}, 0, 0, 0) for i in range(3)])
    with pytest.raises(QuotaError, match="bytes"):
        book.report(a, "", [Usage({"limiter": "x" * 600}, 0, 0, 0)])
    with pytest.raises(QuotaError, match="no entries"):
        book.report(a, "", [Usage({}, 0, 0, 0)])
    with pytest.raises(QuotaError, match="domain does not change"):
        book.report(a, "other", [])
    assert book.refused == {"streams": 1, "buckets": 1}


def test_a_reload_changing_only_the_interval_renews_the_bucket() -> None:
    # 1/s burst 2 -> 0.5/s burst 2: the same share (1 token, up to 2) every 2 s instead of
    # every 1 s. Envoy 1.40 ignores a change of fill_interval alone: the bucket is denied
    # (DENY_ALL) and granted anew, never left filling at the old interval
    clock = ManualClock()
    limits = {"per-ip": QuotaLimit(1, 2)}
    book = QuotaBook(lambda: limits, clock=clock)
    a = book.open("a")
    (act,) = book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])[a.id]
    assert (act.share, act.interval) == (Share(1, 2), 1)
    limits["per-ip"] = QuotaLimit(0.5, 2)
    clock.advance(5)
    (act,) = book.report(a, "", [Usage(BUCKET, 5, 3, 0)])[a.id]
    assert act.share == NOTHING
    granted = None
    for _ in range(4):
        clock.advance(5)
        (act,) = book.report(a, "", [Usage(BUCKET, 5, 0, 3)])[a.id]
        if act.share != NOTHING:
            granted = act
            break
    assert granted is not None and (granted.share, granted.interval) == (Share(1, 2), 2)


def test_a_refused_report_changes_nothing() -> None:
    # b's report subscribes BUCKET (a's share would shrink) then passes b's bound: refused
    # whole, so a's shrink is never counted without being sent
    clock = ManualClock()
    limits = {"per-ip": QuotaLimit(10, 10)}
    book = QuotaBook(lambda: limits, clock=clock, max_buckets=2)
    a, b = book.open("a"), book.open("b")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    with pytest.raises(QuotaError, match="at most 2 buckets"):
        book.report(b, "edge", [Usage(BUCKET, 0, 0, 0)] + [Usage({"limiter": str(i)}, 0, 0, 0) for i in range(2)])
    held = a.buckets[BUCKET_KEY]
    assert held.share == held.ledger == Share(10, 10) and not held.until
    assert not b.buckets and book.holders[BUCKET_KEY] == {a.id}


def test_holds_in_all_streams_are_bounded() -> None:
    clock = ManualClock()
    book = QuotaBook(lambda: {}, clock=clock, max_holds=3)
    a, b = book.open("a"), book.open("b")
    book.report(a, "edge", [Usage({"limiter": str(i)}, 0, 0, 0) for i in range(2)])
    with pytest.raises(QuotaError, match="3 buckets are held by all streams"):
        book.report(b, "edge", [Usage({"limiter": str(i)}, 0, 0, 0) for i in range(2, 4)])
    book.report(b, "edge", [Usage({"limiter": "0"}, 0, 0, 0)])  # the third hold
    assert book.holds == 3 and book.refused == {"buckets": 1}
    book.close(a)
    clock.advance(book.ttl)
    book.report(b, "", [])
    assert book.holds == 1


def test_enforce_envoy_limiters_are_served_here_and_skipped_by_the_check(tmp_path: Path) -> None:
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text("version: 1\nlimiters:\n"
                           "  - {name: edge-ip, type: request_rate, rate: 10, burst: 30, cost: 2,"
                           " key: [{source_ip: true}], enforce: envoy}\n"
                           "  - {name: user-rate, type: request_rate, rate: 1, burst: 2}\n")
    policy = load_policy([policy_file])
    assert limits_of(policy) == {"edge-ip": QuotaLimit(5, 15)}  # Envoy takes one token a request
    assert [lim.name for lim in build_limiters(policy, Keys())] == ["user-rate"]


def test_status_never_shows_a_header_value() -> None:
    bucket = (("header:x-api-key", "sk_live_secret"), ("limiter", "key-rate"), ("source_ip", "10.0.0.1"))
    out = shown(bucket)
    assert out["limiter"] == "key-rate" and out["source_ip"] == "10.0.0.1"
    assert valid_hash(out["header:x-api-key"]) and "sk_live_secret" not in str(out)
    # keyed with the identity salt, as identities are: another salt, another hash
    assert shown(bucket, b"salt")["header:x-api-key"] != out["header:x-api-key"]


def test_status_shows_only_the_generators_entries_raw() -> None:
    # a hand-written Envoy config may name its entries as it likes: only the limiter, the
    # client address and the method are shown as they are
    bucket = (("api_key", "sk_live_secret"), ("limiter", "key-rate"), ("method", "GET"), ("tenant", "acme"))
    out = shown(bucket)
    assert out["limiter"] == "key-rate" and out["method"] == "GET"
    assert valid_hash(out["api_key"]) and valid_hash(out["tenant"])
    assert "sk_live_secret" not in str(out) and "acme" not in str(out)


def test_reported_numbers_are_bounded() -> None:
    clock = ManualClock()
    book = _book(clock)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    clock.advance(5)
    book.report(a, "", [Usage(BUCKET, float("inf"), 2**64 - 1, -5)])
    (held,) = a.buckets.values()
    assert held.allowed == 10**12 and held.denied == 0
    assert held.demand == 1.0  # 10**12 requests over 10**12 s


def test_one_stream_alone_gets_what_divide_gives_it() -> None:
    rnd = random.Random(7)
    for _ in range(200):
        limit = Share(rnd.randint(0, 30), rnd.randint(0, 30))
        held = Share(rnd.randint(0, 40), rnd.randint(0, 40))
        alone = limit if limit.fill and limit.burst else NOTHING  # Envoy's token bucket needs both
        assert divide(limit, {"a": rnd.random() * 10}, {"a": held}) == {"a": alone}


def test_cooling_of_a_bucket_no_stream_holds_ends_and_is_forgotten() -> None:
    clock = ManualClock(1e9)  # a large monotonic clock: float rests must not loop the sweep
    book = _book(clock, rate=3, burst=7)
    a = book.open("a")
    book.report(a, "edge", [Usage(BUCKET, 0, 0, 0)])
    book.close(a)
    clock.advance(book.ttl)
    b = book.open("b")  # a's hold goes: its 7 tokens cool at the 3 a second no hold has
    assert book.cooling[BUCKET_KEY][0] == 7 and not book.holders
    clock.advance(7 / 3 + 1e-7)
    book.open("c")
    assert BUCKET_KEY not in book.cooling and not book._cooled
    (act,) = book.report(b, "edge", [Usage(BUCKET, 0, 0, 1)])[b.id]
    assert act.share == Share(3, 7)  # nothing cools: a new bucket gets the whole limit
