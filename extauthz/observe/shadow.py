"""The dark-launch record: what shadow limiters would have refused, and the report on it.

:class:`ShadowRecorder` (an Observer) notes each shadow would-denial in memory on the
request path (a dict update) and flushes once a second, off the request path, to the
store's bounded event log (``Store.append_events`` at ``Keys.shadow_log``: a ring buffer
in the embedded store, a capped stream in Redis, shared by every replica). Within one
flush, would-denials with the same limiter, tier, plan, route and identity are one event with a
``count`` and the lowest headroom seen, so a noisy user does not flood the log.

:func:`build_report` turns the events of a time window into, per limiter, the most
affected identities and routes with counts and minimum headroom: what ``extauthz report``
prints and ``GET /shadow`` returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.errors import StoreError
from ..core.verdict import Decision, Outcome
from ..policy.model import Policy
from ..store.base import Store, load_json
from .base import ObserverBase
from .logs import route_of

log = logging.getLogger("extauthz.shadow")

#: events kept in the store's log (about; Redis trims approximately).
LOG_MAXLEN = 100_000
#: the log disappears this long after its last append.
LOG_TTL = 7 * 24 * 3600.0
#: distinct (limiter, tier, plan, route, identity) groups held between two flushes.
MAX_PENDING = 10_000

_Group = tuple[str, str, str, str, str, str]  # limiter, tier, plan, route, identity, identity source


@dataclass(eq=False)
class ShadowRecorder(ObserverBase):
    """Counts shadow limiters' would-denials by group and flushes them to the store's log
    ``key`` (about ``maxlen`` events, gone ``ttl`` seconds after its last append); at most
    ``max_pending`` groups between two flushes, a would-denial of another group dropped
    and counted."""

    store: Store
    key: str
    _: KW_ONLY
    clock: Clock = SYSTEM_CLOCK
    maxlen: int = LOG_MAXLEN
    ttl: float = LOG_TTL
    max_pending: int = MAX_PENDING
    #: group -> [count, min headroom (or None), first seen, reason]
    _pending: dict[_Group, list[Any]] = field(default_factory=dict, init=False)
    recorded: int = field(default=0, init=False)
    dropped: int = field(default=0, init=False)
    flushed: int = field(default=0, init=False)
    _failing: bool = field(default=False, init=False)
    #: one flush at a time: a flush called while another is writing (``GET /shadow``,
    #: stop, a test) waits for that write, so what was noted before it is in the store
    #: when it returns.
    _flushing: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    # -- Observer ---------------------------------------------------------------------------
    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        for v in decision.verdicts:
            if v.outcome is not Outcome.SHADOW_DENIED:
                continue
            self.recorded += 1
            headroom = v.remaining / v.limit if v.remaining is not None and v.limit else None
            who, source = ctx.identity, ctx.identity_source
            index = policy.key_index.get(v.limiter) if ctx.keys else None
            if index is not None and index < len(ctx.keys):  # a keyed limiter: who it counts
                who, source = ctx.keys[index][0], policy.keys[index].label
            group = (v.limiter, ctx.tier.value, ctx.plan, route_of(ctx), who, source)
            entry = self._pending.get(group)
            if entry is None:
                if len(self._pending) >= self.max_pending:
                    self.dropped += 1
                    continue
                self._pending[group] = [1, headroom, self.clock.wall(), v.reason]
            else:
                entry[0] += 1
                if headroom is not None and (entry[1] is None or headroom < entry[1]):
                    entry[1] = headroom

    # -- background ---------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Write what was noted since the last flush; returns the number of events written.

        When it returns, everything noted before the call is in the store (or counted as
        dropped), including what a concurrent flush had taken and was still writing."""
        async with self._flushing:
            return await self._flush()

    async def _flush(self) -> int:
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        events = [
            json.dumps({"ts": round(first, 3), "limiter": limiter, "tier": tier, "plan": plan, "route": route,
                        "identity": identity, "identity_source": source, "count": count,
                        "min_headroom": None if headroom is None else round(headroom, 4),
                        "reason": reason}, separators=(",", ":"))
            for (limiter, tier, plan, route, identity, source), (count, headroom, first, reason) in pending.items()
        ]
        try:
            await self.store.append_events(self.key, events, self.maxlen, self.ttl)
        except StoreError as exc:
            self.dropped += sum(e[0] for e in pending.values())
            if not self._failing:
                log.warning("could not record shadow would-denials: %s", exc,
                            extra={"fields": {"event": "shadow_record_failed", "error": str(exc)}})
            self._failing = True
            return 0
        self._failing = False
        self.flushed += len(events)
        return len(events)


def _headroom_min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def build_report(events: Iterable[str], *, top: int = 10) -> list[dict[str, Any]]:
    """Per limiter (most would-denials first): totals, the ``top`` identities and routes."""
    limiters: dict[str, dict[str, Any]] = {}
    for raw in events:
        try:
            e: Any = load_json(raw)  # a ValueError for anything malformed, nesting too
            name = str(e["limiter"])
            count = int(e.get("count", 1))
        except (ValueError, KeyError, TypeError, OverflowError):
            continue  # one bad event (Infinity: OverflowError; NaN: ValueError) is skipped
        headroom = e.get("min_headroom")
        if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not math.isfinite(headroom):
            headroom = None  # not a finite number: no headroom known
        lim = limiters.setdefault(name, {"limiter": name, "would_deny": 0, "first": e.get("ts"),
                                         "last": e.get("ts"), "tiers": {}, "plans": {}, "reasons": {},
                                         "_ids": {}, "_routes": {}})
        lim["would_deny"] += count
        lim["last"] = e.get("ts")
        tier = str(e.get("tier", ""))
        lim["tiers"][tier] = lim["tiers"].get(tier, 0) + count
        plan = str(e.get("plan", ""))
        if plan:
            lim["plans"][plan] = lim["plans"].get(plan, 0) + count
        reason = str(e.get("reason", ""))
        lim["reasons"][reason] = lim["reasons"].get(reason, 0) + count
        ident = lim["_ids"].setdefault(str(e.get("identity", "")), {
            "identity": str(e.get("identity", "")), "identity_source": e.get("identity_source", ""),
            "count": 0, "min_headroom": None, "tiers": set(), "plans": set(), "routes": set()})
        ident["count"] += count
        ident["min_headroom"] = _headroom_min(ident["min_headroom"], headroom)
        ident["tiers"].add(tier)
        if plan:
            ident["plans"].add(plan)
        ident["routes"].add(str(e.get("route", "")))
        route = lim["_routes"].setdefault(str(e.get("route", "")), {
            "route": str(e.get("route", "")), "count": 0, "min_headroom": None, "identities": set()})
        route["count"] += count
        route["min_headroom"] = _headroom_min(route["min_headroom"], headroom)
        route["identities"].add(ident["identity"])
    out = []
    for lim in sorted(limiters.values(), key=lambda x: (-x["would_deny"], x["limiter"])):
        ids = sorted(lim.pop("_ids").values(), key=lambda x: (-x["count"], x["identity"]))
        routes = sorted(lim.pop("_routes").values(), key=lambda x: (-x["count"], x["route"]))
        lim["identities"] = len(ids)
        lim["routes"] = len(routes)
        lim["top_identities"] = [
            {**i, "tiers": sorted(i["tiers"]), "plans": sorted(i["plans"]), "routes": len(i["routes"])}
            for i in ids[:top]
        ]
        lim["top_routes"] = [{**r, "identities": len(r["identities"])} for r in routes[:top]]
        out.append(lim)
    return out


def _pct(h: float | None) -> str:
    return "-" if h is None else f"{h:.0%}"


def format_report(report: dict[str, Any]) -> str:
    """The report as text for people (``extauthz report``)."""
    window = report.get("window")
    limiters = report.get("limiters") or []
    total = sum(int(lim["would_deny"]) for lim in limiters)
    lines = [f"shadow would-denials in the last {window:g} s: {total:,} by {len(limiters)} "
             f"limiter{'s' if len(limiters) != 1 else ''}"
             if isinstance(window, (int, float)) else "shadow would-denials"]
    if not limiters:
        lines.append("none: no shadow limiter would have refused anything in this window.")
    for lim in limiters:
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(lim["tiers"].items(), key=lambda x: -x[1]))
        plans = ", ".join(f"{p} {n}" for p, n in sorted(lim.get("plans", {}).items(), key=lambda x: -x[1]))
        lines += [
            "",
            f"limiter {lim['limiter']}: {lim['would_deny']} would-denials, {lim['identities']} identities, "
            f"{lim['routes']} routes (tiers: {tiers}{'; plans: ' + plans if plans else ''})",
            f"  {'identity':<26} {'source':<20} {'count':>8} {'min headroom':>13}  tiers  plans",
        ]
        for i in lim["top_identities"]:
            lines.append(f"  {i['identity']:<26} {i['identity_source']:<20} {i['count']:>8} "
                         f"{_pct(i['min_headroom']):>13}  {','.join(i['tiers'])}  "
                         f"{','.join(i.get('plans', [])) or '-'}"
                         + (f"  = {i['label']}" if i.get("label") else ""))  # report --identities
        lines.append(f"  {'route':<48} {'count':>8} {'min headroom':>13} {'identities':>11}")
        for r in lim["top_routes"]:
            lines.append(f"  {r['route'][:48]:<48} {r['count']:>8} {_pct(r['min_headroom']):>13} "
                         f"{r['identities']:>11}")
    return "\n".join(lines)


def report_from_events(events: list[str], *, window: float, since: float, top: int = 10) -> dict[str, Any]:
    return {"window": window, "since": since, "events": len(events),
            "limiters": build_report(events, top=top)}


async def read_report(store: Store, key: str, window: float, *, now: float, top: int = 10) -> dict[str, Any]:
    """The report over the last ``window`` seconds of the store's shadow log."""
    since = now - window
    events = await store.read_events(key, since)
    return report_from_events(events, window=window, since=since, top=top)
