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

What the routes read and change is the server's
:class:`~extauthz.server.fleetstate.ReplicaControl`, the one control path of
:mod:`extauthz.control.control` (the CLI with ``--redis-url`` runs the same rules): a switch names a
limiter of the live policy (404 otherwise; a switch that is set can always be cleared), an
override the policy would not apply is refused (400), the store's failures are 503, and every
change of a switch or an override is recorded (:mod:`extauthz.control.changelog`) with the reason
(``X-Extauthz-Reason``) and who: the token's name and the user the client names. The routes
only translate HTTP.

The port itself (and the metrics port) is started by :mod:`extauthz.server.ports`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from ..control.control import ControlError, StoreControl, StoreFailed, UnknownLimiter
from ..control.overrides import DEFAULT_TTL, OverrideError, make_override
from ..core.verdict import Mode
from ..policy.schema import parse_duration
from ..store.base import load_json
from .adminauth import ACTOR, HEALTH_PATH, AdminGuard

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


def _failed(exc: ControlError) -> web.Response:
    """A refused or failed change, with the status its kind says."""
    if isinstance(exc, UnknownLimiter):
        return _error(404, str(exc), limiters=exc.known)
    return _error(503 if isinstance(exc, StoreFailed) else 400, str(exc))


def admin_app(control: StoreControl, guard: AdminGuard | None = None) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        return _json(await control.status())

    async def switches(request: web.Request) -> web.Response:
        return _json(await control.switches())

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
        try:
            return _json(await control.set_switch(name, mode))
        except ControlError as exc:
            return _failed(exc)

    async def shadow(request: web.Request) -> web.Response:
        try:
            window = parse_window(request.query.get("window", "3600"))
            top = parse_top(request.query.get("top", "10"))
        except ValueError as exc:
            return _error(400, str(exc))
        try:
            return _json(await control.shadow_report(window, top))
        except ControlError as exc:
            return _failed(exc)

    async def overrides(request: web.Request) -> web.Response:
        return _json(await control.overrides())

    async def put_override(request: web.Request) -> web.Response:
        limiter, identity = request.match_info["limiter"], request.match_info["identity"]
        try:
            if request.content_length is not None and request.content_length > MAX_BODY:
                raise OverrideError(f"the body is larger than {MAX_BODY} bytes")
            body = load_json(await request.text())
            if not isinstance(body, dict):
                raise OverrideError('the body is a JSON object {"numbers": {...}, "ttl": seconds, ...}')
            numbers = body.get("numbers")
            if not isinstance(numbers, dict):
                raise OverrideError('"numbers" is an object like {"rate": 1000, "burst": 5000}')
            actor = ACTOR.get()  # the override row says what the change log says
            new = make_override(limiter, identity, numbers, ttl=body.get("ttl", DEFAULT_TTL),
                                reason=(actor.reason if actor is not None and actor.reason
                                        else str(body.get("reason", ""))),
                                by=actor.by if actor is not None and actor.by else str(body.get("by", "")),
                                source=str(body.get("source", "")), now=control.wall(),
                                kind=control.limiter_kind(limiter))
            return _json(await control.set_override(new))
        except ControlError as exc:
            return _failed(exc)
        except (ValueError, TypeError) as exc:  # OverrideError, JSON errors
            return _error(400, str(exc))

    async def delete_override(request: web.Request) -> web.Response:
        limiter = request.match_info["limiter"]
        try:
            rows = await control.clear_override(limiter, request.match_info["identity"])
        except ControlError as exc:
            return _failed(exc)
        if rows is None:
            return _error(404, f"no override for limiter {limiter!r} and that identity")
        return _json(rows)

    async def history(request: web.Request) -> web.Response:
        try:
            changes = await control.history()
        except ControlError as exc:
            return _failed(exc)
        return _json({"changes": [c.to_dict() for c in changes]})

    async def customer(request: web.Request) -> web.Response:
        try:
            return _json(await control.customer(request.match_info["identity"], request.query.get("plan")))
        except ControlError as exc:
            return _failed(exc)

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
