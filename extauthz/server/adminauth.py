"""The admin port's lock: which ``Host`` values it answers, the bearer token, the custom header.

What holds on every admin request (:class:`AdminGuard`, an aiohttp middleware), except
``GET /healthz``:

* **Host.** The ``Host`` header must name a loopback host (``localhost``, ``127.x.y.z``,
  ``::1``), the address ``--admin-listen`` binds when that is a specific one, or a name given
  with ``--admin-hosts``; any other is refused (403). A web page that re-points its own DNS
  name at 127.0.0.1 (DNS rebinding) sends its own name as ``Host``, so it cannot reach the
  port through a browser.
* **Token** (``--admin-token-file``). When set, every request carries
  ``Authorization: Bearer TOKEN`` (401 otherwise), compared in constant time. The file holds
  one bare token, or ``NAME:TOKEN`` lines (one per operator or tool: the change log then
  names who made a change); blank lines and ``#`` comments are skipped; a token has at least
  :data:`MIN_TOKEN` characters. The file is read again when it changes (size, mtime or inode:
  a rotated Kubernetes Secret), at the next request, as a whole or not at all: a file with a
  bad line keeps the previous tokens, logged at error level and shown in ``/status``
  (``admin.token_file``); a deleted file revokes them all (:class:`TokenFile`).
* **Mutating routes** (PUT, POST, DELETE) need something a browser cannot send cross-origin
  without a CORS preflight (which this port never grants): the token, or without one the
  :data:`CLIENT_HEADER` header. With a token, a change also needs a reason
  (:data:`REASON_HEADER`, 400 without).

The server refuses to start with the admin port on a non-loopback address and no token
(:func:`require_token_when_exposed`). The metrics port has none of this: it is read-only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from pathlib import Path

from aiohttp import web

from ..control.admintokens import CLIENT_HEADER as CLIENT_HEADER
from ..control.admintokens import MIN_TOKEN as MIN_TOKEN
from ..control.admintokens import REASON_HEADER as REASON_HEADER
from ..control.admintokens import TEXT_MAX as TEXT_MAX
from ..control.admintokens import USER_HEADER as USER_HEADER
from ..control.admintokens import AdminConfigError as AdminConfigError
from ..control.admintokens import client_token as client_token
from ..control.admintokens import parse_tokens as parse_tokens
from ..control.changelog import text_problem
from ..control.control import Actor as Actor
from .ports import parse_listen

log = logging.getLogger("extauthz.server")

#: the route that answers without token or Host check (probes).
HEALTH_PATH = "/healthz"
_MUTATING = frozenset({"PUT", "POST", "DELETE", "PATCH"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "::1"})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenFile:
    """The tokens of ``--admin-token-file``, read again when the file changes (size, mtime or
    inode), as a whole or not at all:

    * a file that cannot be used (a malformed line, no token, unreadable) changes nothing: the
      tokens read last stay in force, an error line is logged once per version of the file,
      and :meth:`status` says so (``ok: false``, the error with the file and line, since when)
      until a good file replaces it;
    * a file that is gone revokes every token it held: every admin request but ``/healthz``
      is refused (401) until a file is back (the metrics port still answers); logged once.
    """

    def __init__(self, path: str | Path, *, wall: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.wall = wall
        #: the (inode, size, mtime) of the file last read, good or not; None: the file is gone
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: list[tuple[bytes, str]] = []
        self.reloads = 0
        self.errors = 0
        #: why the tokens in force are not the file's ("" while they are), and since when
        self.error = ""
        self.since: float | None = None
        first = self._stat()
        if first is None:
            raise AdminConfigError(f"cannot read the admin token file {self.path} "
                                   "(--admin-token-file): no such file")
        self._load(first, first=True)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError:
            return (-1, -1, -1)  # there but not readable: _load says why
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _load(self, stamp: tuple[int, int, int], first: bool = False) -> None:
        self._stamp = stamp
        try:
            try:
                text = self.path.read_text()
            except OSError as exc:
                raise AdminConfigError(f"cannot read the admin token file {self.path} "
                                       f"(--admin-token-file): {exc.strerror or exc}") from None
            tokens = parse_tokens(text, str(self.path))
        except AdminConfigError as exc:
            if first:
                raise
            self._failed(f"{exc}; keeping the {len(self._tokens)} tokens read before",
                         "admin_tokens_unreadable")
            return
        self._tokens = [(_digest(t), name) for t, name in tokens.items()]
        self.error, self.since = "", None
        if not first:
            self.reloads += 1
            log.info("admin tokens read again from %s (%d)", self.path, len(self._tokens),
                     extra={"fields": {"event": "admin_tokens_reloaded", "tokens": len(self._tokens)}})

    def _gone(self) -> None:
        self._stamp = None
        self._tokens = []
        self._failed(f"the admin token file {self.path} is gone: every token it held is revoked "
                     "until a file is back", "admin_tokens_revoked")

    def _failed(self, error: str, event: str) -> None:
        self.errors += 1
        self.error = error
        if self.since is None:
            self.since = self.wall()
        log.error("admin tokens not read again: %s", error, extra={"fields": {"event": event, "error": error}})

    def _fresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        if stamp is None:
            self._gone()
        else:
            self._load(stamp)

    def lookup(self, presented: str) -> str | None:
        """The token's name (``""`` for a bare token), or None when no token matches. Every
        token is compared (constant time each), whichever matches."""
        self._fresh()
        digest = _digest(presented)
        found: str | None = None
        for token, name in self._tokens:
            if hmac.compare_digest(digest, token):
                found = name
        return found

    def status(self) -> dict[str, object]:
        """``/status`` ``admin.token_file``: whether the tokens in force are the file's."""
        return {"path": str(self.path), "ok": not self.error, "tokens": len(self._tokens),
                "error": self.error or None, "since": self.since}


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_when_exposed(admin_listen: str | None, token_file: str | None) -> None:
    """Refuse an admin port on a non-loopback address without a token."""
    if admin_listen is None or token_file or is_loopback(parse_listen(admin_listen)[0]):
        return
    raise AdminConfigError(
        f"the admin port would listen on {admin_listen}, not a loopback address, without a "
        "token: anyone reaching it could change kill switches and customers' limits. Give "
        "--admin-token-file (EXTAUTHZ_ADMIN_TOKEN_FILE), or listen on 127.0.0.1")


def _header_host(value: str | None) -> str | None:
    """The host part of a ``Host`` header, lower-cased, or None when malformed."""
    if not value:
        return None
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1:] if end > 0 else "!"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return value[1:end]
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host
    return value if ":" not in value else None


#: the :class:`Actor` of the admin request being handled (set by :class:`AdminGuard` in the
#: request's task, so the handler sees it; aiohttp's typed request keys need 3.12).
ACTOR: ContextVar[Actor | None] = ContextVar("extauthz_admin_actor", default=None)


def _text(request: web.Request, header: str) -> str:
    return urllib.parse.unquote(request.headers.get(header, "")).strip()[:TEXT_MAX]


def _refuse(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


class AdminGuard:
    """The admin port's middleware (module docstring)."""

    def __init__(self, admin_listen: str, *, tokens: TokenFile | None = None,
                 hosts: Iterable[str] = ()) -> None:
        self.tokens = tokens
        own = parse_listen(admin_listen)[0].lower()
        self.hosts = frozenset(hosts) | ({own} if own not in ("0.0.0.0", "::") else set())
        #: refusals by reason (shown in /status)
        self.refused: dict[str, int] = {}

    def host_allowed(self, header: str | None) -> bool:
        host = _header_host(header)
        return host is not None and (is_loopback(host) or host in self.hosts)

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path == HEALTH_PATH and request.method in ("GET", "HEAD"):
            return await handler(request)
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            self._count("host")
            return _refuse(403, f"Host {str(host)[:80]!r} is not allowed on the admin port "
                           "(loopback, the --admin-listen address or --admin-hosts)")
        token: str | None = None
        if self.tokens is not None:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            token = self.tokens.lookup(presented.strip()) if scheme.lower() == "bearer" else None
            if token is None:
                self._count("token")
                return _refuse(401, "the admin port needs Authorization: Bearer TOKEN "
                               "(extauthz commands: --admin-token-file or EXTAUTHZ_ADMIN_TOKEN_FILE)",
                               **{"WWW-Authenticate": 'Bearer realm="extauthz-admin"'})
        actor = Actor(token=token, user=_text(request, USER_HEADER), reason=_text(request, REASON_HEADER))
        if request.method in _MUTATING:
            if self.tokens is None and not request.headers.get(CLIENT_HEADER):
                self._count("client_header")
                return _refuse(403, f"a change on the admin port needs the {CLIENT_HEADER} header "
                               "(the extauthz commands send it) or the admin token")
            if self.tokens is not None and not actor.reason:
                self._count("reason")
                return _refuse(400, f"a change needs a reason ({REASON_HEADER}; extauthz "
                               "commands: --reason) when the admin port has a token")
            problem = (text_problem(actor.reason, f"the reason ({REASON_HEADER})")
                       or text_problem(actor.user, f"the user ({USER_HEADER})"))
            if problem is not None:  # it would be stored and printed: a forged history line
                self._count("control_character")
                return _refuse(400, problem)
        reset = ACTOR.set(actor)
        try:
            return await handler(request)
        finally:
            ACTOR.reset(reset)

    def status(self) -> dict[str, object]:
        return {"token": self.tokens is not None, "hosts": sorted(self.hosts),
                "refused": dict(sorted(self.refused.items())),
                **({"token_reloads": self.tokens.reloads, "token_errors": self.tokens.errors,
                    "token_file": self.tokens.status()} if self.tokens is not None else {})}
