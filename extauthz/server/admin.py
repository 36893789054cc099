"""The admin and metrics HTTP ports (aiohttp, on the server's event loop).

Admin (``--admin-listen``, loopback by default; never the public Check port). Every request
but ``/healthz`` passes :class:`~extauthz.server.adminauth.AdminGuard` first: a loopback or
configured ``Host``, the bearer token when ``--admin-token-file`` is set, and on changes the
``X-Extauthz-Client`` header (or the token) and, with a token, a reason:

=========================  ==========================================================
``GET /status``            policy version and sources, reload error, store, breaker,
                           fail-opens by reason, switches and effective modes, shed
                           levels, leases and access-log counters, shadow recorder
``GET /switches``          the switches and each limiter's policy and effective mode
``PUT /switches/{name}``   body ``enforce`` | ``shadow`` | ``off``; ``*`` is global
``DELETE /switches/{name}`` clear a switch (the policy's ``mode`` applies again)
``GET /shadow?window=1h``  the dark-launch report over the window (``&top=N``)
``GET /overrides``         live per-customer overrides, each with ``applied`` (and why not)
``PUT /overrides/{limiter}/{identity}``  JSON ``{"numbers": {...}, "ttl": 86400, "reason",
                           "by", "source"}``; ``identity`` is the hashed identity
``DELETE /overrides/{limiter}/{identity}``  clear one override
``GET /history``           who changed switches and overrides, when and why (the
                           store's change log: the fleet's on Redis)
``GET /customers/{hash}``  one customer (hashed identity): each limiter's numbers (plan,
                           override), live counters read without changing them, grants this
                           replica holds, its recent refusals here (``?plan=NAME``)
``GET /healthz``           ``{"ok": true}``; no token, no Host check
=========================  ==========================================================

Every change of a switch or an override is recorded (:mod:`extauthz.changelog`) with the
reason (``X-Extauthz-Reason``) and who: the token's name and the user the client names.

The port itself (and the metrics port) is started by :mod:`extauthz.server.ports`; what
the routes read and change is an :class:`AdminBackend` (the server's
:class:`~extauthz.server.operations.Operations`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from ..changelog import Change, ChangeLog, read_history
from ..errors import StoreError, did_you_mean
from ..overrides import OverrideError
from ..policy.schema import parse_duration
from ..store.base import load_json
from ..switches import GLOBAL, SwitchBoard, valid_name
from ..verdict import Mode
from .adminauth import ACTOR, HEALTH_PATH, TEXT_MAX, Actor, AdminGuard


class AdminBackend(Protocol):
    """What the admin routes read and change."""

    switches: SwitchBoard
    changes: ChangeLog

    def status(self) -> dict[str, Any]: ...

    def switch_status(self) -> dict[str, Any]: ...

    def limiter_names(self) -> set[str]: ...

    async def shadow_report(self, window: float, *, top: int = 10) -> dict[str, Any]: ...

    def override_rows(self) -> dict[str, Any]: ...

    async def set_override(self, limiter: str, identity: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Raises OverrideError (a refusal, 400) or StoreError (503)."""

    async def clear_override(self, limiter: str, identity: str) -> bool:
        """False when there was none. Raises StoreError."""

    async def customer(self, identity: str, plan: str | None = None) -> dict[str, Any]:
        """Raises ValueError (a bad hash or plan, 400) or StoreError (503)."""

MAX_WINDOW = 7 * 24 * 3600.0


MAX_TOP = 1000
#: the largest admin request body read (an override is a few hundred bytes).
MAX_BODY = 64 * 1024


def parse_window(value: str) -> float:
    """Seconds (``3600``) or a duration (``1h``, ``15m``); at most :data:`MAX_WINDOW`."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float(parse_duration(value))  # "bad duration 'soon': use ..."
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"window must be a positive number of seconds or a duration like 15m, "
                         f"1h or 24h (got {value[:40]!r})")
    return min(seconds, MAX_WINDOW)


def parse_top(value: str) -> int:
    """A whole number of rows; at most :data:`MAX_TOP`."""
    rows = int(value) if value.isascii() and value.isdigit() and len(value) <= 9 else 0
    if rows < 1:  # 0, 1e9, 2.5, -3, a 5,000-digit number
        raise ValueError(f"top must be a whole number of rows from 1 to {MAX_TOP} (got {value[:40]!r})")
    return min(rows, MAX_TOP)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, indent=2, sort_keys=False, default=str) + "\n",
                        status=status, content_type="application/json")


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return _json({"error": message, **extra}, status)


def admin_app(ops: AdminBackend, guard: AdminGuard | None = None) -> web.Application:
    async def record(kind: str, action: str, target: str, value: Any, reason: str = "",
                     expires_at: float | None = None) -> None:
        """Record a change that landed, with the reason and who (AdminGuard's Actor; ``reason``:
        the one the request's body gave, when no header did)."""
        actor = ACTOR.get() or Actor(token=None, user="", reason="")
        await ops.changes.record(Change(kind=kind, action=action, target=target, value=value,
                                        reason=actor.reason or reason[:TEXT_MAX], by=actor.by,
                                        user=actor.user, expires_at=expires_at))

    async def status(request: web.Request) -> web.Response:
        return _json(ops.status())

    async def switches(request: web.Request) -> web.Response:
        return _json(ops.switch_status())

    async def put_switch(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = (await request.text()).strip().strip('"').lower()
        try:
            mode = Mode(body)
        except ValueError:
            return _error(400, f"mode must be enforce, shadow or off (got {body[:20]!r})")
        return await _change(name, mode)

    async def delete_switch(request: web.Request) -> web.Response:
        return await _change(request.match_info["name"], None)

    async def _change(name: str, mode: Mode | None) -> web.Response:
        known = ops.limiter_names()
        if not valid_name(name) or (name != GLOBAL and name not in known):
            return _error(404, f"no limiter named {name!r} in the policy{did_you_mean(name, known)}",
                          limiters=sorted(known))
        try:
            await ops.switches.change(name, mode)
        except StoreError as exc:
            return _error(503, f"the store did not take the change: {exc}")
        await record("switch", "clear" if mode is None else "set", name,
                     None if mode is None else mode.value)
        return _json(ops.switch_status())

    async def shadow(request: web.Request) -> web.Response:
        try:
            window = parse_window(request.query.get("window", "3600"))
            top = parse_top(request.query.get("top", "10"))
        except ValueError as exc:
            return _error(400, str(exc))
        try:
            report = await ops.shadow_report(window, top=top)
        except StoreError as exc:
            return _error(503, f"cannot read the shadow log: {exc}")
        return _json(report)

    async def overrides(request: web.Request) -> web.Response:
        return _json(ops.override_rows())

    async def put_override(request: web.Request) -> web.Response:
        try:
            if request.content_length is not None and request.content_length > MAX_BODY:
                raise OverrideError(f"the body is larger than {MAX_BODY} bytes")
            body = load_json(await request.text())
            if not isinstance(body, dict):
                raise OverrideError('the body is a JSON object {"numbers": {...}, "ttl": seconds, ...}')
            limiter, identity = request.match_info["limiter"], request.match_info["identity"]
            actor = ACTOR.get()
            if actor is not None:  # the override row says what the change log says
                body = {**body, **({"reason": actor.reason} if actor.reason else {}),
                        **({"by": actor.by} if actor.by else {})}
            rows = await ops.set_override(limiter, identity, body)
        except (ValueError, TypeError) as exc:  # OverrideError, JSON errors
            return _error(400, str(exc))
        except StoreError as exc:
            return _error(503, f"the store did not take the change: {exc}")
        expires_at = next((r["expires_at"] for r in rows.get("overrides", ())  # its expiry: `history`
                           if r["limiter"] == limiter and r["identity"] == identity), None)
        await record("override", "set", f"{limiter} {identity}", body.get("numbers"),
                     str(body.get("reason", "")), expires_at)
        return _json(rows)

    async def delete_override(request: web.Request) -> web.Response:
        limiter = request.match_info["limiter"]
        try:
            found = await ops.clear_override(limiter, request.match_info["identity"])
        except StoreError as exc:
            return _error(503, f"the store did not take the change: {exc}")
        if not found:
            return _error(404, f"no override for limiter {limiter!r} and that identity")
        await record("override", "clear", f"{limiter} {request.match_info['identity']}", None)
        return _json(ops.override_rows())

    async def history(request: web.Request) -> web.Response:
        try:
            changes = await read_history(ops.changes.store, ops.changes.key)
        except StoreError as exc:
            return _error(503, f"cannot read the change log: {exc}")
        return _json({"changes": [c.to_dict() for c in changes]})

    async def customer(request: web.Request) -> web.Response:
        try:
            return _json(await ops.customer(request.match_info["identity"], request.query.get("plan")))
        except ValueError as exc:
            return _error(400, str(exc))
        except StoreError as exc:
            return _error(503, f"cannot read the store: {exc}")

    async def healthz(request: web.Request) -> web.Response:
        return _json({"ok": True})

    app = web.Application(middlewares=[guard.middleware] if guard is not None else [])
    app.router.add_get(HEALTH_PATH, healthz)
    app.router.add_get("/history", history)
    app.router.add_get("/status", status)
    app.router.add_get("/overrides", overrides)
    app.router.add_put("/overrides/{limiter}/{identity}", put_override)
    app.router.add_delete("/overrides/{limiter}/{identity}", delete_override)
    app.router.add_get("/switches", switches)
    app.router.add_put("/switches/{name}", put_switch)
    app.router.add_delete("/switches/{name}", delete_switch)
    app.router.add_get("/shadow", shadow)
    app.router.add_get("/customers/{identity}", customer)
    return app
