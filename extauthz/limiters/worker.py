"""Worker utilization load shedder: the seed's "last line of defense", in one module.

Three parts, one per section below:

* **The request path** (:class:`WorkerUtilizationShedder`): each request draws against its
  tier's drop probability: ``test`` first, then ``get``, then ``post``; never ``critical``.
  A shed request gets 503.
* **The level and its tier mapping** (:func:`drop_probabilities`).
* **The sampler** (:func:`sample_once`, :func:`sampler_job`): off the request path, every
  ``sample_interval``, it reads the utilization signal, advances the shed controller in the
  store (so every replica on one Redis shares one level) and installs the new level.

The controller step itself is :func:`extauthz.store.algorithms.shed_advance`, the one rule
both stores run (``Store.shed_update``; ``lua/shed_state.lua`` on Redis), with its
constants in :class:`extauthz.store.base.ShedParams`.

The level
---------
The controller keeps one number, the shed *level*, in ``[resting, 1]`` where
``resting = -delay_before_shedding / time_to_shed_all`` (computed in floating point; the
gist's Ruby divides integers and gets -1). On every utilization sample:

* below ``good_below`` the level falls at up to ``1 / time_to_shed_all`` per second,
  proportionally to how far below; between ``good_below`` and ``bad_above`` it holds
  (the dead zone); above ``bad_above`` it rises at up to ``1 / time_to_shed_all`` per second;
* the elapsed time used per update is clamped to ``[0, delay_before_shedding]`` so a
  long pause between samples cannot jump the level.

Starting from rest, sustained full utilization therefore sheds nothing for
``delay_before_shedding`` seconds and everything non-critical after
``delay_before_shedding + time_to_shed_all``.

Tier mapping (:func:`drop_probabilities`): the positive part of the level is split into
three equal thirds driving ``test``, then ``get``, then ``post``::

    p_test = clamp(3L)   p_get = clamp(3L - 1)   p_post = clamp(3L - 2)   p_critical = 0

so at every moment test >= get >= post >= critical = 0, the mean over the three tiers
equals the gist's single drop chance ``max(L, 0)``, and recovery retraces the same path.

Signals
-------
* ``inflight``: live leases (the fleet_usage limiter's, else the shedder's own
  count-only leases) divided by ``capacity``;
* ``redis``: a number in [0, 1] that the upstream services publish into a store key
  (``signal.key``, default ``<prefix>:signal:<limiter>``); a missing value reads as 0,
  so a dead publisher lets shedding decay rather than stick;
* ``envoy_admin``: ``cluster.<cluster>.upstream_rq_active`` from an Envoy admin
  endpoint, divided by ``capacity``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from ..core.context import RequestContext
from ..core.runner import DONE
from ..core.tiers import Tier
from ..core.verdict import Outcome, Verdict
from ..policy.schema import WorkerUtilizationSpec
from ..store.algorithms import clamp
from ..store.base import LeaseOp, OpResult, ShedParams, Store
from ..store.keys import Keys
from .base import FleetWide, denied_outcome


class _Shedders(Protocol):
    @property
    def workers(self) -> tuple[WorkerUtilizationShedder, ...]: ...


class EngineView(Protocol):
    """What the sampler reads of the engine, which holds the shedders (the engine imports
    this module, so it is named here, not imported): its store and its live snapshot."""

    store: Store

    @property
    def snapshot(self) -> _Shedders: ...



# --------------------------------------------------------------------------- the request path


class WorkerUtilizationShedder(FleetWide):
    def __init__(self, spec: WorkerUtilizationSpec, keys: Keys, *,
                 rng: random.Random | None = None, inflight_keys: tuple[str, ...] = ()) -> None:
        super().__init__(spec)
        self.spec = spec
        self.signal = spec.signal
        self.sample_interval = spec.sample_interval
        self.params = ShedParams(
            good_below=spec.good_below, bad_above=spec.bad_above,
            delay_before_shedding=spec.delay_before_shedding,
            time_to_shed_all=spec.time_to_shed_all,
            ttl=max(60.0, 2 * (spec.delay_before_shedding + spec.time_to_shed_all)),
        )
        self.state_key = keys.shed_state(spec.name)
        self.signal_key = spec.signal.key or keys.signal(spec.name)
        self._rng = rng or random.Random()
        # The inflight signal counts leases: a fleet_usage limiter's when there is one,
        # else this limiter holds count-only leases of its own.
        self.own_lease_key: str | None = None
        if spec.signal.source == "inflight" and not inflight_keys:
            self.own_lease_key = keys.fleet_leases(spec.name, "all")
            inflight_keys = (self.own_lease_key,)
        self.inflight_keys = inflight_keys
        self.ttl = spec.lease_ttl
        self.retry_after = float(max(1, math.ceil(spec.sample_interval)))
        self.level = self.params.resting
        self.utilization: float | None = None
        self.probabilities = drop_probabilities(self.level)

    def set_level(self, level: float, utilization: float | None = None) -> None:
        self.level = level
        self.utilization = utilization
        self.probabilities = drop_probabilities(level)

    def shed_whole(self) -> frozenset[Tier]:
        """The tiers this shedder refuses whole now (drop probability 1; never critical):
        what ``envoy_deny_all`` pushes to Envoy as DENY_ALL (docs/rlqs.md)."""
        return frozenset(t for t, p in self.probabilities.items() if p >= 1.0 and t is not Tier.CRITICAL)

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict:
        p = self.probabilities[ctx.tier]
        if p > 0.0 and self._rng.random() < p:
            return Verdict(self.name, self.kind, denied_outcome(enforce), limit=1.0,
                           remaining=1.0 - p, retry_after=self.retry_after,
                           reason=f"shedding_{ctx.tier.value}",
                           detail=(f"The API is overloaded and is shedding {ctx.tier.value} "
                                   f"traffic (load shedder '{self.name}', {p:.0%} of it now). "
                                   f"Retry later with backoff."))
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=1.0, remaining=1.0 - p)

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp | None:
        if self.own_lease_key is None:
            return None
        return LeaseOp(self.own_lease_key, 0, self.ttl, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        # Count-only lease: never refuses; the local draw already decided.
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=1.0)


def workers_of(limiters: Iterable[object]) -> tuple[WorkerUtilizationShedder, ...]:
    """The worker utilization shedders among ``limiters``, in order."""
    return tuple([lim for lim in limiters if isinstance(lim, WorkerUtilizationShedder)])


def keep_levels(old: Iterable[WorkerUtilizationShedder], limiters: Iterable[object]) -> None:
    """A reload keeps each shedder's level: the new shedders of ``limiters`` take the level
    of the ``old`` one of the same name."""
    levels = {w.name: w.level for w in old}
    for lim in workers_of(limiters):
        if lim.name in levels:
            lim.set_level(levels[lim.name])


# --------------------------------------------------------------------------- the level


def drop_probabilities(level: float) -> dict[Tier, float]:
    """Per-tier drop probability for a shed level (see the module docstring)."""
    x = 3.0 * level
    return {
        Tier.TEST: clamp(x, 0.0, 1.0),
        Tier.GET: clamp(x - 1.0, 0.0, 1.0),
        Tier.POST: clamp(x - 2.0, 0.0, 1.0),
        Tier.CRITICAL: 0.0,
    }


# --------------------------------------------------------------------------- the sampler


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _envoy_active(url: str, cluster: str, timeout: float) -> float:
    stat = f"cluster.{cluster}.upstream_rq_active"
    query = urllib.parse.urlencode({"filter": f"^{stat.replace('.', '[.]')}$", "format": "json"})
    with _OPENER.open(f"{url.rstrip('/')}/stats?{query}", timeout=timeout) as resp:
        data = json.load(resp)
    for item in data.get("stats", []):
        if item.get("name") == stat:
            return float(item.get("value", 0))
    raise LookupError(f"Envoy at {url} has no stat {stat}")


async def read_utilization(engine: EngineView, shedder: WorkerUtilizationShedder) -> float:
    """The shedder's signal now, in [0, 1] (values above 1 are clamped)."""
    signal = shedder.signal
    if signal.source == "inflight":
        counts = await engine.store.inflight(shedder.inflight_keys)
        value = sum(counts) / float(signal.capacity or 1)
    elif signal.source == "redis":
        raw = await engine.store.get_value(shedder.signal_key)
        value = float(raw) if raw else 0.0
    else:
        active = await asyncio.to_thread(_envoy_active, signal.url or "", signal.cluster or "",
                                         max(0.1, shedder.sample_interval / 2))
        value = active / float(signal.capacity or 1)
    return min(1.0, max(0.0, value))


async def sample_once(engine: EngineView, shedder: WorkerUtilizationShedder,
                      utilization: float | None = None) -> float:
    """One sample: read, advance the shared controller, install the level, return it.
    Raises when the signal or the store failed (the level is then held; the background
    runner counts it as an error of the job ``sampler:<limiter>``). ``utilization``
    replaces reading the signal (``extauthz simulate --signal``)."""
    if utilization is None:
        utilization = await read_utilization(engine, shedder)
    level = await engine.store.shed_update(shedder.state_key, utilization, shedder.params)
    # The snapshot may have been replaced by a reload: update the live shedder by name.
    for live in engine.snapshot.workers:
        if live.name == shedder.name:
            live.set_level(level, utilization)
    return level


def sampler_job(engine: EngineView, name: str) -> tuple[Callable[[], float], Callable[[], Awaitable[object]]]:
    """(interval, tick) of the named shedder's sampler job for the background runner; the
    tick ends the job (``DONE``) once a reload removed the shedder."""
    def find() -> WorkerUtilizationShedder | None:
        return next((w for w in engine.snapshot.workers if w.name == name), None)

    def interval() -> float:
        shedder = find()
        return shedder.sample_interval if shedder is not None else 1.0

    async def tick() -> object:
        shedder = find()
        if shedder is None:
            return DONE
        return await sample_once(engine, shedder)

    return interval, tick
