"""The operator's control interface: switches, overrides, the change log, the dark-launch
report and status, behind one :class:`Control`. The rules are written once, in
:class:`StoreControl`, the one control path:

* :class:`StoreControl` works in process on the stored documents (:mod:`extauthz.control.switches`,
  :mod:`extauthz.control.overrides`) with the policy it is given: a switch names a limiter of the
  policy, an override the policy would not apply is refused, and every change is recorded
  in one place, the change log (:class:`~extauthz.control.changelog.ChangeLog`), with who made it
  (:class:`Actor`). The admin routes (:mod:`extauthz.server.admin`) call the server's
  (:class:`~extauthz.server.fleetstate.ReplicaControl`: the live policy, the replica's boards);
  ``extauthz switch|override ... --redis-url`` builds one on the fleet's Redis with the
  policy of ``--policies``, or none: then names are checked for their form only, and
  ``switch`` says so on stderr.
* :class:`AdminControl` is the CLI's client of those admin routes.

Both answer with the admin port's JSON shapes (``{"switches": ...}``,
``{"overrides": [...], "max": N}``). Every failure is a :class:`ControlError` with a message
for people (a store error included): the same words on both paths.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from .. import __version__
from ..core.errors import StoreError, did_you_mean
from ..core.verdict import Mode
from ..store.base import Store
from ..store.keys import Keys
from .changelog import Change, ChangeLog, parse_history, text_problem
from .documents import Held, Stored
from .switches import GLOBAL, SwitchDocument, Switches, limiter_modes, valid_name, with_switch

if TYPE_CHECKING:  # StoreControl imports them when built: the admin port's client starts without the policy's models
    from ..limiters.base import Limiter
    from ..policy.model import Policy
    from .overrides import Override

R = TypeVar("R")


class ControlError(Exception):
    """A refused or failed control request; the message says why."""


class UnknownLimiter(ControlError):
    """A switch for a limiter the policy does not have (404 on the admin port)."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.known = sorted(known)
        super().__init__(f"no limiter named {name!r} in the policy{did_you_mean(name, self.known)}")


class StoreFailed(ControlError):
    """The store did not answer or take the change (503 on the admin port)."""


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change and why, as the change log records it: the admin token's name (None
    without a token; ``""`` for a bare token), the user the client names (the CLI's OS user or
    ``--by``: the server cannot check it), and the reason given."""

    token: str | None
    user: str
    reason: str

    @property
    def by(self) -> str | None:
        return self.token or None


class Checks(NamedTuple):
    """What changes are checked against: the policy's limiters (a switch names one, an
    override must apply to one), its identity rule labels (an override is hashed for one) and
    the policy itself when known (the limiters' types and modes)."""

    limiters: Sequence[Limiter]
    labels: Sequence[str] | None
    policy: Policy | None


class Control(Protocol):
    """What an operator reads and changes. ``where``: what was talked to (an admin URL, or
    ``redis``), known after the first call."""

    @property
    def where(self) -> str: ...

    async def switches(self) -> dict[str, Any]: ...

    async def set_switch(self, name: str, mode: Mode | None) -> dict[str, Any]:
        """Set (None: clear) one switch; the switches after the change."""

    async def overrides(self) -> dict[str, Any]: ...

    async def set_override(self, new: Override) -> dict[str, Any]:
        """Set one (validated) override; the overrides after the change."""

    async def clear_override(self, limiter: str, identity: str) -> dict[str, Any] | None:
        """The overrides after the change, or None when there was no such override."""

    async def history(self) -> list[Change]: ...

    async def shadow_report(self, window: float, top: int) -> dict[str, Any]: ...

    async def status(self) -> dict[str, Any]: ...

    async def customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        """One customer's limiters and live counters (:mod:`extauthz.control.inspect`)."""


# -- the admin port -----------------------------------------------------------------------


@dataclass
class AdminTarget:
    """Where the admin requests go: candidate base URLs, tried in order while the connection
    is refused (a default that a restart moved; nothing was sent then), and the token."""

    bases: list[str]
    token: str | None = None
    reason: str = ""
    user: str = ""
    #: the base URL that answered
    used: str | None = field(default=None)


class AdminHttpError(ControlError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def admin_request(target: AdminTarget, method: str, path: str, body: str | None = None) -> Any:
    """One admin request (blocking); the JSON answer. Says once on stderr which admin URL
    answered. Raises AdminHttpError (an error status) or ControlError (unreachable)."""
    from .admintokens import CLIENT_HEADER, REASON_HEADER, USER_HEADER

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"content-type": "text/plain", CLIENT_HEADER: f"extauthz/{__version__}",
               USER_HEADER: urllib.parse.quote(target.user)}
    if target.reason:
        headers[REASON_HEADER] = urllib.parse.quote(target.reason)
    if target.token is not None:
        headers["Authorization"] = f"Bearer {target.token}"
    bases = [target.used] if target.used else target.bases
    for n, base in enumerate(bases):
        url = f"{base}{path}"
        req = urllib.request.Request(url, method=method, data=body.encode() if body is not None else None,
                                     headers=headers)
        try:
            with opener.open(req, timeout=10) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            _said(target, base)
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = exc.reason
            raise AdminHttpError(f"{method} {url}: {exc.code} {message}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
            if refused and n + 1 < len(bases):
                continue  # nothing was sent: try the next candidate
            tried = f" (tried {', '.join(bases)})" if len(bases) > 1 else ""
            raise ControlError(f"cannot reach the admin port at {url}: {exc}{tried}") from None
        _said(target, base)
        return data
    raise ControlError("no admin URL to try")


def _said(target: AdminTarget, base: str) -> None:
    """Say once which server (admin URL) this command talked to."""
    if target.used is None:
        target.used = base
        print(f"extauthz: admin port {base}", file=sys.stderr)


class AdminControl:
    """:class:`Control` through a server's admin port."""

    def __init__(self, target: AdminTarget) -> None:
        self.target = target

    @property
    def where(self) -> str:
        return str(self.target.used)

    def _call(self, method: str, path: str, body: str | None = None) -> Any:
        return admin_request(self.target, method, path, body)

    async def switches(self) -> dict[str, Any]:
        return dict(self._call("GET", "/switches"))

    async def set_switch(self, name: str, mode: Mode | None) -> dict[str, Any]:
        path = f"/switches/{urllib.parse.quote(name, safe='')}"
        if mode is None:
            return dict(self._call("DELETE", path))
        return dict(self._call("PUT", path, mode.value))

    async def overrides(self) -> dict[str, Any]:
        return dict(self._call("GET", "/overrides"))

    def _override_path(self, limiter: str, identity: str) -> str:
        return f"/overrides/{urllib.parse.quote(limiter, safe='')}/{urllib.parse.quote(identity, safe='')}"

    async def set_override(self, new: Override) -> dict[str, Any]:
        return dict(self._call("PUT", self._override_path(new.limiter, new.identity), json.dumps({
            "numbers": dict(new.numbers), "ttl": new.expires_at - new.set_at,
            "reason": new.reason, "by": new.by, "source": new.source})))

    async def clear_override(self, limiter: str, identity: str) -> dict[str, Any] | None:
        try:
            return dict(self._call("DELETE", self._override_path(limiter, identity)))
        except AdminHttpError as exc:
            if exc.status == 404:
                return None
            raise

    async def history(self) -> list[Change]:
        data = self._call("GET", "/history")
        return parse_history(json.dumps(c) for c in data.get("changes", []))

    async def shadow_report(self, window: float, top: int) -> dict[str, Any]:
        return dict(self._call("GET", f"/shadow?window={window:g}&top={top}"))

    async def status(self) -> dict[str, Any]:
        return dict(self._call("GET", "/status"))

    async def customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        query = f"?plan={urllib.parse.quote(plan, safe='')}" if plan else ""
        return dict(self._call("GET", f"/customers/{urllib.parse.quote(identity, safe='')}{query}"))


# -- in process: the one control path ---------------------------------------------------


def check_switch(name: str, limiters: Sequence[Limiter] | None, *, clearing_set: bool = False) -> None:
    """Refuse a switch name that is malformed or, with the policy's ``limiters``, names none
    of them (``*``, the global switch, names no limiter). ``clearing_set``: the switch is set
    and being cleared, which is always allowed (one a reload's rename left behind would apply
    again if the name came back). The rule of :class:`StoreControl`, and of the CLI given
    --policies before it sends a switch to set."""
    if not valid_name(name):
        raise ControlError(f"bad switch name {name!r}")
    if limiters is not None and name != GLOBAL and not clearing_set:
        known = {lim.name for lim in limiters}
        if name not in known:
            raise UnknownLimiter(name, known)


@dataclass
class StoreControl:
    """:class:`Control` in process, on the documents every replica reads: here the store's
    (``extauthz ... --redis-url``; the server's admin routes use its subclass
    :class:`~extauthz.server.fleetstate.ReplicaControl`). ``limiters`` and ``labels`` (the
    policy's limiters and identity rule labels, when the caller has the policy): a switch for
    another limiter and an override that would not apply are refused, and listings say which
    apply; without them names are checked for their form only. Changes are recorded in the
    change log as made by ``user`` for ``reason``, ``via`` the store."""

    store: Store
    keys: Keys
    limiters: Sequence[Limiter] | None = None
    labels: Sequence[str] | None = None
    user: str = ""
    reason: str = ""
    wall: Callable[[], float] = time.time
    #: the fleet's policy (``inspect``: which limiters, with which numbers; ``switch --list``:
    #: their modes)
    policy: Policy | None = None
    #: how the change reached the store, as the change log says (``redis``, ``admin``)
    via: str = "redis"

    def __post_init__(self) -> None:
        problem = text_problem(self.reason, "the reason") or text_problem(self.user, "the user")
        if problem is not None:  # what the admin port refuses (400), refused here too
            raise ControlError(problem)
        from .overrides import OverrideDocument

        self.switch_doc: Held[Switches] = Stored(self.store, SwitchDocument(self.keys.switches), wall=self.wall)
        self.override_doc: Held[list[Override]] = Stored(self.store, OverrideDocument(self.keys), wall=self.wall)
        #: a command prints its own result: the change log's record goes to the store only
        self.changes = ChangeLog(self.store, self.keys.history, wall=self.wall, log_changes=False)

    @property
    def where(self) -> str:
        return "redis"

    def checks(self) -> Checks | None:
        """The policy changes are checked against, or None (names checked for form only)."""
        if self.limiters is None:
            return None
        return Checks(self.limiters, self.labels, self.policy)

    def actor(self) -> Actor:
        """Who makes the change being made."""
        return Actor(token=None, user=self.user, reason=self.reason)

    def limiter_kind(self, name: str) -> str | None:
        """The type of the policy's limiter ``name`` (an override's numbers are that kind's),
        or None when unknown."""
        checks = self.checks()
        policy = checks.policy if checks is not None else None
        if policy is None:
            return None
        return next((spec.type for spec in policy.limiters if spec.name == name), None)

    async def _store(self, call: Awaitable[R], failing: str) -> R:
        try:
            return await call
        except StoreError as exc:
            raise StoreFailed(f"{failing}: {type(exc).__name__}: {exc}") from None

    async def _record(self, kind: str, action: str, target: str, value: Any,
                      expires_at: float | None = None, reason: str = "") -> None:
        """Record a change that landed, with who made it and why (``reason``: the one an
        override carries, when the actor gave none): the one place every change is logged."""
        from .admintokens import TEXT_MAX

        who = self.actor()
        await self.changes.record(Change(
            kind=kind, action=action, target=target, value=value, reason=(who.reason or reason)[:TEXT_MAX],
            by=who.by, user=who.user[:TEXT_MAX], at=self.wall(), via=self.via, expires_at=expires_at))

    # -- switches -------------------------------------------------------------------------
    def _switch_rows(self, current: Switches) -> dict[str, Any]:
        out: dict[str, Any] = {"switches": current.to_dict()}
        checks = self.checks()
        if checks is not None and checks.policy is not None:
            out["limiters"] = limiter_modes(current, checks.policy.limiters)
        return out

    async def switches(self) -> dict[str, Any]:
        try:
            current = await self._store(self.switch_doc.read(), "cannot read the switches")
        except ValueError as exc:
            raise ControlError(f"malformed switches in the store: {exc}") from None
        return self._switch_rows(current)

    async def set_switch(self, name: str, mode: Mode | None) -> dict[str, Any]:
        checks = self.checks()
        limiters = checks.limiters if checks is not None else None
        check_switch(name, limiters if mode is not None else None)  # refused before any store call

        def edit(current: Switches) -> Switches:
            if mode is None:  # a clear: checked against what is set
                check_switch(name, limiters, clearing_set=name in current.to_dict())
            return with_switch(current, name, mode)

        new = await self._store(self.switch_doc.update(edit), "the store did not take the change")
        await self._record("switch", "clear" if mode is None else "set", name,
                           None if mode is None else mode.value)
        return self._switch_rows(new)

    # -- overrides ------------------------------------------------------------------------
    def _rows(self, entries: Sequence[Override], now: float) -> dict[str, Any]:
        from .overrides import MAX_OVERRIDES, compile_overrides, describe

        checks = self.checks()
        not_applied = (compile_overrides(entries, checks.limiters, now, checks.labels)[1]
                       if checks is not None else None)
        return {"overrides": describe(entries, not_applied, now), "max": MAX_OVERRIDES}

    async def overrides(self) -> dict[str, Any]:
        try:
            entries = await self._store(self.override_doc.read(), "cannot read the overrides")
        except ValueError as exc:
            raise ControlError(f"malformed overrides in the store: {exc}") from None
        return self._rows(entries, self.wall())

    async def set_override(self, new: Override) -> dict[str, Any]:
        """Raises OverrideError (refused: nothing is written) or StoreFailed."""
        from .overrides import refuse_unapplied, with_override

        checks = self.checks()
        if checks is not None:
            refuse_unapplied(new, checks.limiters, checks.labels)
        now = self.wall()
        entries = await self._store(self.override_doc.update(lambda e: with_override(e, new, now)),
                                    "the store did not take the change")
        await self._record("override", "set", f"{new.limiter} {new.identity}", dict(new.numbers),
                           new.expires_at, new.reason)
        return self._rows(entries, now)

    async def clear_override(self, limiter: str, identity: str) -> dict[str, Any] | None:
        from .overrides import without_override

        now = self.wall()
        found = False

        def clear(entries: list[Override]) -> list[Override]:
            nonlocal found
            out, found = without_override(entries, limiter, identity, now)
            return out

        entries = await self._store(self.override_doc.update(clear), "the store did not take the change")
        if not found:
            return None
        await self._record("override", "clear", f"{limiter} {identity}", None)
        return self._rows(entries, now)

    # -- reading --------------------------------------------------------------------------
    async def history(self) -> list[Change]:
        return await self._store(self.changes.read(), "cannot read the change log")

    async def shadow_report(self, window: float, top: int) -> dict[str, Any]:
        from ..observe.shadow import report_from_events
        from ..store.redis import RedisStore
        from ..store.redis_events import read_events

        if not isinstance(self.store, RedisStore):
            raise ControlError("the shadow log is read from Redis or a server's admin port")
        since = self.wall() - window
        events = await self._store(read_events(self.store.client, self.keys.shadow_log, since),
                                   "cannot read the shadow log")
        return report_from_events(events, window=window, since=since, top=top)

    async def status(self) -> dict[str, Any]:
        raise ControlError("status comes from a server's admin port (--admin or --listen)")

    async def _customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        """One customer's view on the documents and the store (policy required)."""
        from .inspect import customer_view

        checks = self.checks()
        if checks is None or checks.policy is None:
            raise ControlError("with --redis-url, --policies names the fleet's policy (its limiters and numbers)")
        try:
            switches = await self._store(self.switch_doc.read(), "cannot read the store")
            entries = await self._store(self.override_doc.read(), "cannot read the store")
        except ValueError as exc:
            raise ControlError(f"malformed switches or overrides in the store: {exc}") from None
        try:
            return await self._store(customer_view(
                identity, policy=checks.policy, limiters=checks.limiters, store=self.store, keys=self.keys,
                overrides=entries, switches=switches, wall=self.wall(), plan=plan), "cannot read the store")
        except ValueError as exc:  # a bad hash or plan
            raise ControlError(str(exc)) from None

    async def customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        view = await self._customer(identity, plan)
        view["recent_refusals"] = {"covers": "kept by each server (its admin port): not in the store"}
        return view
