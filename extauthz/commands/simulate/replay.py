"""Replay traffic through the server's own engine on a virtual clock.

Each policy replayed gets a :class:`Lane`: a :class:`~extauthz.core.clock.ManualClock`, an
embedded :class:`~extauthz.store.memory.MemoryStore` on it, and the same
:class:`~extauthz.engine.engine.Engine` (classifier, limiters, shedders) ``extauthz serve`` builds,
with a seeded ``random.Random`` for the worker shedder's draws. Nothing here decides
anything itself: no limiter, bucket or controller is reimplemented.

For every request, in time order, a lane first plays the events due up to the request's
start, in time order: lease releases (a heap of ``start + duration``) and worker shedder
samples (``limiters.worker.sample_once``, the server's own sampling code, every ``sample_interval``
of virtual time). Then it sets the clock to the start and asks the engine.

The embedded store answers within the call, so ``await engine.decide(ctx)`` completes in
one step: :func:`run_now` drives the coroutine with one ``send`` and no event loop (a
coroutine that would really wait is an error, never a silent sleep).
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ...core.clock import ManualClock
from ...core.context import RawRequest, RequestContext
from ...core.tiers import Tier
from ...core.verdict import Decision, Outcome
from ...engine.engine import Engine
from ...engine.storegate import StoreGate
from ...limiters.worker import sample_once
from ...policy.model import Policy
from ...store.memory import MemoryStore
from .advice import Timelines
from .traffic import Request, TrafficError

T = TypeVar("T")
_TIERS = {t.value: t for t in Tier}
_NOT_REFUSING = (Outcome.ALLOWED, Outcome.FAILED_OPEN)


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (embedded store calls)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a replayed call waited: only the embedded store can be replayed")


class SignalSeries:
    """``--signal FILE``: utilization inputs over time for shedders whose signal is not
    ``inflight``. JSON lines ``{"time": t, "value": v}`` (optionally ``"limiter": name``);
    the value holds until the next point. ``redis`` sources: the number the services
    publish (0..1); ``envoy_admin`` sources: ``upstream_rq_active``, divided by the
    signal's ``capacity`` like the sampler does."""

    def __init__(self, points: Mapping[str, list[tuple[float, float]]]) -> None:
        self._points = {name: sorted(p) for name, p in points.items()}
        self._times = {name: [t for t, _ in p] for name, p in self._points.items()}

    @classmethod
    def load(cls, path: str | Path) -> SignalSeries:
        import json

        points: dict[str, list[tuple[float, float]]] = {}
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t, v = float(obj["time"]), float(obj["value"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TrafficError(f"{path}:{lineno}: a signal line needs numbers 'time' and "
                                   f"'value' ({exc})") from None
            points.setdefault(str(obj.get("limiter", "*")), []).append((t, v))
        return cls(points)

    def value(self, limiter: str, t: float) -> float:
        name = limiter if limiter in self._points else "*"
        times = self._times.get(name)
        if not times:
            return 0.0
        i = bisect.bisect_right(times, t) - 1
        return self._points[name][i][1] if i >= 0 else 0.0


@dataclass
class Series:
    """Per-second counts for the report (kept only when asked for)."""

    refused_by_limiter: dict[str, Counter[int]] = field(default_factory=dict)
    requests_by_tier: dict[str, Counter[int]] = field(default_factory=dict)
    refused_by_tier: dict[str, Counter[int]] = field(default_factory=dict)
    #: second -> requests allowed (the load that reaches the upstream)
    allowed: Counter[int] = field(default_factory=Counter)
    #: shedder -> [(time, level, utilization)]
    levels: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    start: float | None = None


class Tally:
    """What one lane decided, in the shape of ``simulate --json``."""

    def __init__(self) -> None:
        self.requests = 0
        self.allowed = 0
        self.refused = 0
        #: limiter -> requests it refused or would have refused (shadow)
        self.limiter_refused: Counter[str] = Counter()
        #: limiter -> requests it skipped (a part of its key yielded nothing)
        self.limiter_skipped: Counter[str] = Counter()
        self.limiter_identities: dict[str, set[str]] = {}
        self.tier_requests: Counter[str] = Counter()
        self.tier_refused: Counter[str] = Counter()
        self.identity_requests: Counter[str] = Counter()
        self.identity_refused: Counter[str] = Counter()
        #: (identity, limiter) and (identity, tier) -> refusals: the per-customer table
        self.identity_limiter_refused: Counter[tuple[str, str]] = Counter()
        self.identity_tier_refused: Counter[tuple[str, str]] = Counter()

    def add(self, ctx: RequestContext, decision: Decision) -> None:
        self.requests += 1
        tier = ctx.tier.value
        self.tier_requests[tier] += 1
        ident = ctx.identity
        self.identity_requests[ident] += 1
        if decision.allowed:
            self.allowed += 1
        else:
            self.refused += 1
            self.tier_refused[tier] += 1
            self.identity_refused[ident] += 1
            self.identity_tier_refused[(ident, tier)] += 1
        for v in decision.verdicts:
            if v.outcome not in _NOT_REFUSING:
                self.limiter_refused[v.limiter] += 1
                self.limiter_identities.setdefault(v.limiter, set()).add(ident)
                self.identity_limiter_refused[(ident, v.limiter)] += 1
        for name in decision.skipped:
            self.limiter_skipped[name] += 1

    def customer(self, ident: str) -> dict[str, Any]:
        """One identity's refusals, by limiter and by tier (``customers`` rows)."""
        return {"refused": self.identity_refused[ident],
                "by_limiter": {lim: n for (i, lim), n in sorted(self.identity_limiter_refused.items())
                               if i == ident},
                "by_tier": {tier: n for (i, tier), n in sorted(self.identity_tier_refused.items())
                            if i == ident}}

    def summary(self, policy: Policy, top: int = 10) -> dict[str, Any]:
        names = [spec.name for spec in policy.limiters]
        names += sorted(set(self.limiter_refused) - set(names))
        shares = [n / self.identity_requests[i] for i, n in self.identity_refused.items()]
        return {
            "requests": self.requests,
            "allowed": self.allowed,
            "refused": self.refused,
            # the figures --fail-on compares (FIGURES)
            "critical_refused": self.tier_refused[Tier.CRITICAL.value],
            "refused_share": self.refused / self.requests if self.requests else 0.0,
            "customers_refused": len(self.identity_refused),
            "max_customer_refused_share": max(shares, default=0.0),
            "by_limiter": {name: {"refused": self.limiter_refused[name],
                                  "identities": len(self.limiter_identities.get(name, ())),
                                  # keyed limiters: requests whose key was missing
                                  **({"skipped_key_missing": self.limiter_skipped[name]}
                                     if name in policy.key_index else {})}
                           for name in names},
            "by_tier": {tier: {"requests": n, "refused": self.tier_refused[tier]}
                        for tier, n in sorted(self.tier_requests.items())},
            "top_identities": [
                {"identity": ident, "refused": n, "requests": self.identity_requests[ident]}
                for ident, n in self.identity_refused.most_common(top)
            ],
        }


class Lane:
    """One policy replayed: its own virtual clock, embedded store and engine."""

    def __init__(self, name: str, policy: Policy, *, seed: int = 0, salt: bytes = b"",
                 series: bool = False, signal: SignalSeries | None = None) -> None:
        self.name = name
        self.policy = policy
        self.clock = ManualClock(0.0)
        self.store = MemoryStore(self.clock)
        self.engine = Engine(StoreGate(self.store, clock=self.clock), policy, rng=random.Random(seed), salt=salt)
        self.tally = Tally()
        #: each identity's requests, for the numbers that would admit them (the candidate's)
        self.timelines: Timelines | None = None
        self.series = Series() if series else None
        self.signal = signal
        self._releases: list[tuple[float, int, tuple[str, ...], str]] = []
        self._seq = 0
        #: shedder name -> next sample time (virtual)
        self._samples: dict[str, float] = {}
        self._next_sample = float("inf")
        self.unsignalled: list[str] = []
        self.samples = 0
        #: classification is a pure function of the request's fields: the same shape of
        #: request (user, method, path, host, tier) is classified once.
        self._contexts: dict[tuple[Any, ...], RequestContext] = {}

    def start(self, t0: float) -> None:
        self.clock.set(t0)
        for shedder in self.engine.snapshot.workers:
            self._samples[shedder.name] = t0
            if shedder.signal.source != "inflight" and self.signal is None:
                self.unsignalled.append(shedder.name)
        self._next_sample = min(self._samples.values(), default=float("inf"))
        if self.series is not None:
            self.series.start = t0

    def context(self, req: Request) -> RequestContext:
        key = (req.identity, req.plan, req.method, req.path, req.host, req.tier, req.source_ip,
               *req.headers.items())
        ctx = self._contexts.get(key)
        if ctx is None:
            if len(self._contexts) >= 1_000_000:
                self._contexts.clear()
            ctx = self._contexts[key] = self._classify(req)
        return ctx

    def _classify(self, req: Request) -> RequestContext:
        classifier = self.engine.snapshot.classifier
        if req.identity is None:
            return classifier.context(RawRequest(req.method, req.path, req.host, req.headers,
                                                 source_ip=req.source_ip, route_tier=req.tier))
        tier = _TIERS.get(req.tier or "")
        why = "recorded"
        if tier is None:  # a recording without a tier: classify like the server would
            ctx = classifier.context(RawRequest(req.method, req.path, req.host, req.headers,
                                                source_ip=req.source_ip))
            tier, why = ctx.tier, ctx.tier_source
        plan, plan_source = "", ""
        policy = self.policy
        if policy.plan_sources:  # the recorded plan if the candidate knows it, else its default
            if req.plan and req.plan in policy.plan_names:
                plan, plan_source = req.plan, "recorded"
            else:
                plan, plan_source = policy.plan_default, "unknown" if req.plan else "default"
        method = req.method.upper()
        keys = (classifier.keys(RawRequest(method, req.path, req.host, req.headers, source_ip=req.source_ip),
                                req.identity, method, plan) if policy.keys else ())
        return RequestContext(tier=tier, identity=req.identity, identity_source=req.identity_source,
                              test_mode=tier is Tier.TEST, method=req.method, path=req.path,
                              host=req.host, tier_source=why, headers=req.headers, plan=plan,
                              plan_source=plan_source, keys=keys)

    def _sample(self, name: str, t: float) -> None:
        self.clock.set(t)
        shedder = next(w for w in self.engine.snapshot.workers if w.name == name)
        source = shedder.signal.source
        utilization: float | None = None
        if source != "inflight":
            value = self.signal.value(name, t) if self.signal is not None else 0.0
            if source == "redis":  # the sampler's own path: publish, then read the key
                run_now(self.store.set_value(shedder.signal_key, repr(value)))
            else:
                utilization = min(1.0, max(0.0, value / float(shedder.signal.capacity or 1)))
        level = run_now(sample_once(self.engine, shedder, utilization))
        self.samples += 1
        if self.series is not None and level is not None:
            self.series.levels.setdefault(name, []).append((t, level, shedder.utilization or 0.0))
        self._samples[name] = t + shedder.sample_interval
        self._next_sample = min(self._samples.values())

    def _until(self, t: float) -> None:
        """Play the releases and samples due at or before ``t``, in time order."""
        releases = self._releases
        release_now = self.store.release_now
        while True:
            r = releases[0][0] if releases else float("inf")
            s = self._next_sample
            if r <= s:
                if r > t:
                    return
                _, _, keys, lease_id = heapq.heappop(releases)
                self.clock.set(r)
                release_now(keys, lease_id)
            else:
                if s > t:
                    return
                name = min(self._samples, key=self._samples.__getitem__)
                self._sample(name, s)

    def step(self, req: Request, ctx: RequestContext) -> Decision:
        t = req.time
        if (self._releases and self._releases[0][0] <= t) or self._next_sample <= t:
            self._until(t)
        self.clock.now = t
        decision = run_now(self.engine.decide(ctx))
        if decision.leases and req.duration is not None:
            self._seq += 1
            heapq.heappush(self._releases, (t + req.duration, self._seq, decision.leases, decision.lease_id))
        self.tally.add(ctx, decision)
        if self.timelines is not None:
            self.timelines.add(ctx, t, req.duration, decision)
        series = self.series
        if series is not None:
            second = int(t - (series.start or 0.0))
            tier = ctx.tier.value
            series.requests_by_tier.setdefault(tier, Counter())[second] += 1
            if decision.allowed:
                series.allowed[second] += 1
            else:
                series.refused_by_tier.setdefault(tier, Counter())[second] += 1
            for v in decision.verdicts:
                if v.outcome not in _NOT_REFUSING:
                    series.refused_by_limiter.setdefault(v.limiter, Counter())[second] += 1
        return decision


@dataclass
class ReplayedRequest:
    """The decisions of the candidate and the baseline on one request (``on_decision``)."""

    request: Request
    context: RequestContext
    candidate: Decision
    baseline: Decision | None


class Replay:
    """The candidate policy (and optionally a baseline) over one stream of requests."""

    def __init__(self, candidate: Policy, baseline: Policy | None = None, *, seed: int = 0,
                 salt: bytes = b"", series: bool = False, signal: SignalSeries | None = None,
                 on_decision: Callable[[ReplayedRequest], None] | None = None) -> None:
        self.candidate = Lane("candidate", candidate, seed=seed, salt=salt, series=series, signal=signal)
        self.baseline = (Lane("baseline", baseline, seed=seed, salt=salt, series=series, signal=signal)
                         if baseline is not None else None)
        self.candidate.timelines = Timelines(self.candidate.engine.snapshot.limiters)
        self.on_decision = on_decision
        #: identities refused by the candidate and not by the baseline, and the reverse.
        self.candidate_only: Counter[str] = Counter()
        self.baseline_only: Counter[str] = Counter()
        self.elapsed = 0.0
        self.first: float | None = None
        self.last: float | None = None

    @property
    def lanes(self) -> list[Lane]:
        return [self.candidate] + ([self.baseline] if self.baseline is not None else [])

    def run(self, requests: Iterable[Request], progress: Callable[[int], None] | None = None,
            progress_every: int = 65536) -> Replay:
        started = time.perf_counter()
        cand, base = self.candidate, self.baseline
        on_decision = self.on_decision
        n = 0
        for req in requests:
            if self.first is None:
                self.first = req.time
                for lane in self.lanes:
                    lane.start(req.time)
            ctx = cand.context(req)
            d1 = cand.step(req, ctx)
            if base is not None:
                ctx2 = ctx if req.identity is not None else base.context(req)
                d2 = base.step(req, ctx2)
                if d1.allowed != d2.allowed:
                    (self.baseline_only if d1.allowed else self.candidate_only)[ctx.identity] += 1
            else:
                d2 = None
            if on_decision is not None:
                on_decision(ReplayedRequest(req, ctx, d1, d2))
            n += 1
            if progress is not None and n % progress_every == 0:
                progress(n)
        self.last = req.time if n else None
        self.elapsed = time.perf_counter() - started
        return self

    @property
    def requests_per_second(self) -> float:
        return self.candidate.tally.requests / self.elapsed if self.elapsed > 0 else 0.0

    def customers(self, top: int = 10, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """The ``top`` customers whose outcome changes most from the baseline to the candidate
        (without a baseline: the most refused), with their share of the traffic and their
        refusals by limiter and tier in each policy; ``labels`` (hash -> name, from
        ``--identities``) names them."""
        cand = self.candidate.tally
        base = self.baseline.tally if self.baseline is not None else None
        idents = set(cand.identity_refused) | (set(base.identity_refused) if base is not None else set())

        def change(i: str) -> int:
            return cand.identity_refused[i] - (base.identity_refused[i] if base is not None else 0)

        ranked = sorted(idents, key=lambda i: (-abs(change(i)), -cand.identity_refused[i], i))[:top]
        rows = []
        for ident in ranked:
            row: dict[str, Any] = {"identity": ident}
            if labels and ident in labels:
                row["label"] = labels[ident]
            row |= {"requests": cand.identity_requests[ident],
                    "share_of_traffic": cand.identity_requests[ident] / cand.requests if cand.requests else 0.0,
                    "candidate": cand.customer(ident)}
            if base is not None:
                row["baseline"] = base.customer(ident)
                row["change"] = change(ident)
            advice = self.would_admit(ident)
            if advice:
                row["would_admit"] = advice
            rows.append(row)
        return rows

    def would_admit(self, identity: str) -> dict[str, dict[str, Any]]:
        """For each candidate limiter that refused ``identity`` (and counts per identity): the
        smallest numbers that would have admitted all its requests (:mod:`.advice`)."""
        cand = self.candidate
        refused_by = [lim for (i, lim), n in sorted(cand.tally.identity_limiter_refused.items())
                      if i == identity and n]
        return cand.timelines.advice(identity, refused_by) if cand.timelines is not None and refused_by else {}

    def summary(self, top: int = 10, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        out = self.candidate.tally.summary(self.candidate.policy, top)
        out["customers"] = self.customers(top, labels)
        if self.baseline is not None:
            out["baseline"] = self.baseline.tally.summary(self.baseline.policy, top)
            out["difference"] = {
                "refused_by_candidate_only": sum(self.candidate_only.values()),
                "refused_by_baseline_only": sum(self.baseline_only.values()),
                "identities_refused_by_candidate_only": len(self.candidate_only),
                "identities_refused_by_baseline_only": len(self.baseline_only),
                "top_identities_hurt": [{"identity": i, "requests": n}
                                        for i, n in self.candidate_only.most_common(top)],
                "top_identities_spared": [{"identity": i, "requests": n}
                                          for i, n in self.baseline_only.most_common(top)],
            }
        if labels:  # --identities: name every row whose hash it knows
            rows = [*out["top_identities"], *out.get("difference", {}).get("top_identities_hurt", []),
                    *out.get("difference", {}).get("top_identities_spared", [])]
            for row in rows:
                if row["identity"] in labels:
                    row["label"] = labels[row["identity"]]
        return out
