"""What operators change at run time, on every replica: the kill switches and the live
overrides (two stored documents, :mod:`extauthz.documents`), this replica's rules for changing
them (a switch names a limiter of the policy; an override the policy would not apply is
refused), and the change log. Polled once a second by the server's runner; a part of
``/status`` and ``/metrics`` (:mod:`extauthz.observe.state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric

from ..changelog import ChangeLog
from ..clock import Clock
from ..engine import Engine
from ..observe.state import ModesPart, OverridesPart
from ..overrides import (
    DEFAULT_TTL,
    MAX_OVERRIDES,
    Override,
    OverrideBoard,
    OverrideError,
    make_override,
    refuse_unapplied,
    with_override,
    without_override,
)
from ..store.base import Store
from ..store.keys import Keys
from ..switches import SwitchBoard


class FleetState:
    def __init__(self, engine: Engine, store: Store, keys: Keys, clock: Clock, *,
                 interval: float = 1.0) -> None:
        self.engine = engine
        self.clock = clock
        self.interval = interval
        self.switches = SwitchBoard(store, keys.switches, engine.set_switches, interval=interval)
        self.overrides = OverrideBoard(store, keys, engine.set_overrides, wall=clock.wall)
        #: who changed switches and overrides, and why (the last ones; the store's log)
        self.changes = ChangeLog(store, keys.history, wall=clock.wall)
        self._modes = ModesPart(engine)
        self._overrides = OverridesPart(engine, self.overrides.status)

    async def poll(self) -> None:
        """The one poll of what operators change at run time: kill switches and overrides."""
        await self.switches.poll_once()
        await self.overrides.poll_once()

    # -- the part of /status and /metrics -------------------------------------------------
    def status(self) -> Mapping[str, Any]:
        return {"switch_poll": self.switches.status(), **self._overrides.status()}

    def metrics(self) -> Iterable[Metric]:
        return self._overrides.metrics()

    # -- switches -------------------------------------------------------------------------
    def limiter_names(self) -> set[str]:
        return {spec.name for spec in self.engine.snapshot.policy.limiters}

    def switch_status(self) -> dict[str, Any]:
        return dict(self._modes.status())

    # -- overrides ------------------------------------------------------------------------
    def override_rows(self) -> dict[str, Any]:
        return {"overrides": self._overrides.rows(), "max": MAX_OVERRIDES}

    async def set_override(self, limiter: str, identity: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Set one override (the admin port). This replica knows the policy, so an override
        that would not apply is refused. Raises OverrideError or StoreError."""
        numbers = body.get("numbers")
        if not isinstance(numbers, dict):
            raise OverrideError('"numbers" is an object like {"rate": 1000, "burst": 5000}')
        now = self.clock.wall()
        snap = self.engine.snapshot
        kind = next((spec.type for spec in snap.policy.limiters if spec.name == limiter), None)
        new = make_override(limiter, identity, numbers, ttl=body.get("ttl", DEFAULT_TTL),
                            reason=str(body.get("reason", "")), by=str(body.get("by", "")),
                            source=str(body.get("source", "")), now=now, kind=kind)
        refuse_unapplied(new, snap.limiters, snap.policy.identity_labels)
        await self.overrides.change(lambda entries: with_override(entries, new, now))
        return self.override_rows()

    async def clear_override(self, limiter: str, identity: str) -> bool:
        """False when there was none. Raises StoreError."""
        found = False

        def clear(entries: list[Override]) -> list[Override]:
            nonlocal found
            out, found = without_override(entries, limiter, identity, self.clock.wall())
            return out

        await self.overrides.change(clear)
        return found
