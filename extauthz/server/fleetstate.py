"""What operators change at run time, on every replica: the kill switches and the live
overrides (two stored documents, :mod:`extauthz.control.documents`) and the change log
(:class:`FleetState`, polled once a second by the server's runner; a part of ``/status`` and
``/metrics``, :mod:`extauthz.engine.state`), and the admin routes' control
(:class:`ReplicaControl`): the one control path of :mod:`extauthz.control.control` with this
replica's live policy, boards and change log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric

from ..control.changelog import ChangeLog
from ..control.control import Actor, Checks, StoreControl
from ..control.overrides import OverrideBoard
from ..control.switches import SwitchBoard
from ..core.clock import Clock
from ..engine.engine import Engine
from ..engine.state import OverridesPart
from ..observe.setup import Observability
from ..store.base import Store
from ..store.keys import Keys
from .adminauth import ACTOR


class FleetState:
    def __init__(self, engine: Engine, store: Store, keys: Keys, clock: Clock, *,
                 interval: float = 1.0) -> None:
        self.engine = engine
        self.store = store
        self.keys = keys
        self.clock = clock
        self.interval = interval
        self.switches = SwitchBoard(store, keys.switches, engine.set_switches, interval=interval)
        self.overrides = OverrideBoard(store, keys, engine.set_overrides, wall=clock.wall)
        #: who changed switches and overrides, and why (the last ones; the store's log)
        self.changes = ChangeLog(store, keys.history, wall=clock.wall)
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


class ReplicaControl(StoreControl):
    """The admin routes' :class:`~extauthz.control.control.Control`: the rules of
    :class:`~extauthz.control.control.StoreControl` checked against the policy this replica serves now
    (the engine's snapshot: a reload changes it), changes made through the replica's boards
    (applied here at once) and recorded in its change log (logged, kept for ``/status``) as
    made by the admin request's :class:`~extauthz.control.control.Actor`. ``/status``, a customer's
    recent refusals and grants held, and the shadow report come from the replica."""

    def __init__(self, fleet: FleetState, *, observe: Observability, status: Callable[[], dict[str, Any]]) -> None:
        super().__init__(fleet.store, fleet.keys, wall=fleet.clock.wall, via="admin")
        self.engine = fleet.engine
        self.observe = observe
        self._status = status
        self.switch_doc = fleet.switches
        self.override_doc = fleet.overrides
        self.changes = fleet.changes

    @property
    def where(self) -> str:
        return "admin"

    def checks(self) -> Checks:
        snap = self.engine.snapshot
        return Checks(snap.limiters, snap.policy.identity_labels, snap.policy)

    def actor(self) -> Actor:
        return ACTOR.get() or Actor(token=None, user="", reason="")

    async def status(self) -> dict[str, Any]:
        return self._status()

    async def shadow_report(self, window: float, top: int) -> dict[str, Any]:
        from ..observe.shadow import read_report

        await self.observe.shadow.flush()  # include what this replica noted in the last second
        return await self._store(read_report(self.store, self.keys.shadow_log, window, now=self.wall(), top=top),
                                 "cannot read the shadow log")

    async def customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        """One customer's limiters, live counters, the grants this replica holds and its
        recent refusals here (``GET /customers/<hash>``; :mod:`extauthz.control.inspect`)."""
        from ..control.inspect import held_grants

        view = await self._customer(identity, plan)
        held_grants(view, self.engine.snapshot.limiters, self.keys, self.wall())
        refusals = self.observe.refusals
        view["recent_refusals"] = {**refusals.describe(), "refusals": refusals.of(identity)}
        return view
