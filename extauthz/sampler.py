"""Utilization sampling for the worker utilization shedders: off the request path.

Every ``sample_interval`` each shedder reads its signal, advances the shared controller
in the store (``Store.shed_update``: one state per fleet when the store is Redis, so all
replicas converge on one level), and installs the new level for the request path.

Signals (``signal.source``):

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
import logging
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable

from .engine import Engine
from .limiters.worker import WorkerUtilizationShedder
from .runner import DONE

log = logging.getLogger("extauthz.sampler")

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


async def read_utilization(engine: Engine, shedder: WorkerUtilizationShedder) -> float:
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


async def sample_once(engine: Engine, shedder: WorkerUtilizationShedder,
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


def sampler_job(engine: Engine, name: str) -> tuple[Callable[[], float], Callable[[], Awaitable[object]]]:
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
