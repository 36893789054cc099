"""The operator's control interface: switches, overrides, the change log, the dark-launch
report and status, behind one :class:`Control` with two implementations, so the CLI
(:mod:`extauthz.opscli`) states no rule of its own:

* :class:`AdminControl` talks to a running server's admin port
  (:mod:`extauthz.server.admin`), which applies the rules with its own policy.
* :class:`StoreControl` works on the store itself (the fleet's Redis, from the CLI): the
  same stored documents (:mod:`extauthz.switches`, :mod:`extauthz.overrides`), the same
  checks against a policy when one is given, the same change log.

Both answer with the admin port's JSON shapes (``{"switches": ...}``,
``{"overrides": [...], "max": N}``). Every failure is a :class:`ControlError` with a message
for people (a store error included).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from . import __version__
from .changelog import Change, append_change, parse_history, read_history, text_problem
from .errors import StoreError
from .store.base import Store
from .store.keys import Keys
from .switches import SwitchDocument, with_switch
from .verdict import Mode

if TYPE_CHECKING:  # StoreControl imports them when built: the admin port's client starts without the policy's models
    from .limiters.base import Limiter
    from .overrides import Override
    from .policy.model import Policy

R = TypeVar("R")


class ControlError(Exception):
    """A refused or failed control request; the message says why."""


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
        """One customer's limiters and live counters (:mod:`extauthz.inspect`)."""


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
    from .server.admintokens import CLIENT_HEADER, REASON_HEADER, USER_HEADER

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


# -- the store ----------------------------------------------------------------------------


@dataclass
class StoreControl:
    """:class:`Control` on the store every replica reads. ``limiters`` and ``labels`` (the
    policy's limiters and identity rule labels, when the caller has the policy): an override
    that would not apply is refused, and listings say which apply. Changes are recorded in
    the change log as made by ``user`` for ``reason``, ``via`` the store."""

    store: Store
    keys: Keys
    limiters: Sequence[Limiter] | None = None
    labels: Sequence[str] | None = None
    user: str = ""
    reason: str = ""
    wall: Callable[[], float] = time.time
    #: the fleet's policy (``inspect``: which limiters, with which numbers)
    policy: Policy | None = None

    def __post_init__(self) -> None:
        problem = text_problem(self.reason, "the reason") or text_problem(self.user, "the user")
        if problem is not None:  # what the admin port refuses (400), refused here too
            raise ControlError(problem)
        from .overrides import OverrideDocument

        self.switch_doc = SwitchDocument(self.keys.switches)
        self.override_doc = OverrideDocument(self.keys)

    @property
    def where(self) -> str:
        return "redis"

    async def _store(self, call: Awaitable[R]) -> R:
        try:
            return await call
        except StoreError as exc:
            raise ControlError(f"{type(exc).__name__}: {exc}") from None

    async def _record(self, kind: str, action: str, target: str, value: Any,
                      expires_at: float | None = None) -> None:
        """A change made straight on the store goes to the fleet's change log too (no token:
        ``by`` is empty, ``user`` the OS user or --by)."""
        from .server.admintokens import TEXT_MAX

        await self._store(append_change(self.store, self.keys.history, Change(
            kind=kind, action=action, target=target, value=value, reason=self.reason[:TEXT_MAX],
            user=self.user[:TEXT_MAX], at=self.wall(), via="redis", expires_at=expires_at)))

    async def switches(self) -> dict[str, Any]:
        try:
            current = await self._store(self.switch_doc.read(self.store))
        except ValueError as exc:
            raise ControlError(f"malformed switches in the store: {exc}") from None
        return {"switches": current.to_dict()}

    async def set_switch(self, name: str, mode: Mode | None) -> dict[str, Any]:
        from .switches import valid_name

        if not valid_name(name):
            raise ControlError(f"bad switch name {name!r}")
        new, _ = await self._store(self.switch_doc.change(
            self.store, lambda current: with_switch(current, name, mode), self.wall()))
        await self._record("switch", "clear" if mode is None else "set", name,
                           None if mode is None else mode.value)
        return {"switches": new.to_dict()}

    def _rows(self, entries: Sequence[Override], now: float) -> dict[str, Any]:
        from .overrides import MAX_OVERRIDES, compile_overrides, describe

        not_applied = (compile_overrides(entries, self.limiters, now, self.labels)[1]
                       if self.limiters is not None else None)
        return {"overrides": describe(entries, not_applied, now), "max": MAX_OVERRIDES}

    async def overrides(self) -> dict[str, Any]:
        try:
            entries = await self._store(self.override_doc.read(self.store))
        except ValueError as exc:
            raise ControlError(f"malformed overrides in the store: {exc}") from None
        return self._rows(entries, self.wall())

    async def set_override(self, new: Override) -> dict[str, Any]:
        from .overrides import refuse_unapplied, with_override

        if self.limiters is not None:
            refuse_unapplied(new, self.limiters, self.labels)
        now = self.wall()
        entries, _ = await self._store(self.override_doc.change(
            self.store, lambda e: with_override(e, new, now), now))
        await self._record("override", "set", f"{new.limiter} {new.identity}", dict(new.numbers),
                           new.expires_at)
        return self._rows(entries, now)

    async def clear_override(self, limiter: str, identity: str) -> dict[str, Any] | None:
        from .overrides import without_override

        now = self.wall()
        found = False

        def clear(entries: list[Override]) -> list[Override]:
            nonlocal found
            out, found = without_override(entries, limiter, identity, now)
            return out

        entries, _ = await self._store(self.override_doc.change(self.store, clear, now))
        if not found:
            return None
        await self._record("override", "clear", f"{limiter} {identity}", None)
        return self._rows(entries, now)

    async def history(self) -> list[Change]:
        return await self._store(read_history(self.store, self.keys.history))

    async def shadow_report(self, window: float, top: int) -> dict[str, Any]:
        from .observe.shadow import report_from_events
        from .store.redis import RedisStore
        from .store.redis_events import read_events

        if not isinstance(self.store, RedisStore):
            raise ControlError("the shadow log is read from Redis or a server's admin port")
        since = self.wall() - window
        events = await self._store(read_events(self.store.client, self.keys.shadow_log, since))
        return report_from_events(events, window=window, since=since, top=top)

    async def status(self) -> dict[str, Any]:
        raise ControlError("status comes from a server's admin port (--admin or --listen)")

    async def customer(self, identity: str, plan: str | None) -> dict[str, Any]:
        from .inspect import customer_view

        if self.policy is None or self.limiters is None:
            raise ControlError("with --redis-url, --policies names the fleet's policy (its limiters and numbers)")
        try:
            switches = await self._store(self.switch_doc.read(self.store))
            entries = await self._store(self.override_doc.read(self.store))
        except ValueError as exc:
            raise ControlError(f"malformed switches or overrides in the store: {exc}") from None
        try:
            view = await self._store(customer_view(
                identity, policy=self.policy, limiters=self.limiters, store=self.store, keys=self.keys,
                overrides=entries, switches=switches, wall=self.wall(), plan=plan))
        except ValueError as exc:
            raise ControlError(str(exc)) from None
        view["recent_refusals"] = {"covers": "kept by each server (its admin port): not in the store"}
        return view
