"""Envoy's HTTP authorization protocol (``http_service``) on a small asyncio protocol.

Envoy sends the client's method, path and the headers its ``allowed_headers`` lists, without
the body; a 200 admits the request, any other status is the client's answer (docs/http.md has
the field-by-field mapping to the gRPC protocol). The request is converted once into the same
:class:`~extauthz.context.RawRequest` the gRPC edge builds, decided by the same engine, and
answered from the same pieces (:mod:`extauthz.answers`), on the server's own event loop.

The parser is httptools (llhttp). Chosen over uvicorn's httptools server by measurement
(docs/design.md, "HTTP front door"): the same parser, without the ASGI layer per request.

Bounds (a misbehaving client gets a 4xx or a closed connection, never a crash): request line
plus headers at most ``max_header_bytes`` and ``max_headers`` (431), a request whose headers
do not complete within ``header_timeout`` of their first byte, or a new connection's first
request within ``header_timeout`` of the connection (408, closed), more than ``max_connections``
open (the new one closed; the bound follows the file limit, :func:`max_connections_for`, so
that idle connections cannot take the descriptors the admin port, Redis and a policy reload
need), bad syntax (400, closed), an upgrade
(the check is answered, then the connection closed), at most ``max_pipelined`` requests
waiting per connection (reading pauses), and reading pauses while the client does not read
our answers. The request body is never kept.

Answers are corked (:class:`~extauthz.cork.Cork`): the answers one loop turn produces on a
connection (pipelined requests) go out in one socket write, in order: at once when no request
waits behind the last of them, else at the start of the next turn; closing a connection writes
what is held first.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import resource
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httptools

from .. import settings
from ..answers import PROTOCOLS, TIER_HEADER, denial, lease_fields, ratelimit_headers
from ..context import RawRequest, RequestContext
from ..cork import Cork
from ..verdict import Decision
from .ports import parse_listen
from .services import AuthorizationService

log = logging.getLogger("extauthz.server")

#: the status that marks a load shedder's (or a fail-closed limiter's) refusal: Envoy does not
#: forward a 5xx from an authorization service (it counts an error and fails open or closed),
#: so the shipped configs map this status to 503 with ``local_reply_config``.
SHED_STATUS = 420
#: set by a per-route ``header_mutation`` filter from the route (client copies stripped
#: first); the HTTP protocol's stand-in for route metadata.
ROUTE_TIER_HEADER = "x-extauthz-route-tier"
#: where ``jwt_authn``'s ``forward_payload_header`` puts the verified payload (base64url JSON).
JWT_PAYLOAD_HEADER = "x-jwt-payload"
#: the namespace and key the forwarded payload is filed under for ``metadata`` identity rules,
#: as ``jwt_authn`` with ``payload_in_metadata: payload`` files it for the gRPC protocol.
JWT_NAMESPACE = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD_KEY = "payload"
#: Envoy's client-certificate header (``forward_client_cert_details``); ``URI=`` is the principal.
XFCC_HEADER = "x-forwarded-client-cert"
#: the client address: the LAST entry, the one Envoy appends (``use_remote_address: true``).
FORWARDED_FOR_HEADER = "x-forwarded-for"
REQUEST_ID_HEADER = "x-request-id"

#: headers the HTTP edge reads whatever the policy says (``envoy-allowed-headers`` lists them).
EDGE_HEADERS = (REQUEST_ID_HEADER, FORWARDED_FOR_HEADER, ROUTE_TIER_HEADER, JWT_PAYLOAD_HEADER,
                XFCC_HEADER, "traceparent", "tracestate")

#: headers Envoy sends an HTTP authorization service whatever ``allowed_headers`` says.
ALWAYS_SENT = frozenset({"host", ":authority", "authorization", "content-length", ":method", ":path"})

_EMPTY: Mapping[str, str] = {}
_NO_METADATA: Mapping[str, Sequence[Sequence[str]]] = {}
_REASONS = {200: b"OK", 400: b"Bad Request", 408: b"Request Timeout", 420: b"Shedding Load",
            429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error"}


#: :attr:`HttpLimits.max_active_checks` unless set (``serve --http-max-active-checks``).
DEFAULT_MAX_ACTIVE_CHECKS = settings.DEFAULT_MAX_ACTIVE_CHECKS


#: the bound on open connections where the file limit allows it.
MAX_CONNECTIONS = 4096
#: descriptors never given to the HTTP port's connections (a quarter of the file limit, at
#: least this many): the process's own (~25: the event loops, gRPC, logs), the gRPC, admin
#: and metrics ports and their connections, Redis connections, policy and recording files.
MIN_FD_RESERVE = 128


def max_connections_for(nofile: int | None = None) -> int:
    """The HTTP port's default bound on open connections (``--http-max-connections``): the
    soft ``RLIMIT_NOFILE`` (``nofile``) less a reserve, at most :data:`MAX_CONNECTIONS`.
    1,024 descriptors (common in containers) give 768 connections."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY or nofile < 0:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, nofile - max(MIN_FD_RESERVE, nofile // 4)))


@dataclass(frozen=True, slots=True)
class HttpLimits:
    #: request line + header names and values, in bytes.
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    #: seconds from a request's first byte to the end of its headers.
    header_timeout: float = 10.0
    #: seconds a connection may sit with no request before it is closed (Envoy's upstream
    #: connection idle timeout is 1 h by default: keep this above the one Envoy uses).
    idle_timeout: float = 3600.0
    #: requests read ahead of their answers on one connection before reading pauses.
    max_pipelined: int = 32
    #: open connections at once; one more is closed at once, unanswered (Envoy keeps a few
    #: per worker; an idle-connection flood must not hold sockets and memory without bound).
    #: The server sets it from the file limit (:func:`max_connections_for`) unless given.
    max_connections: int = MAX_CONNECTIONS
    #: checks being decided at once, over all connections; more wait their turn before they
    #: start (read, not yet classified). At saturation every active check shares the event
    #: loop, so a loop turn costs about this many checks' CPU: unbounded (Envoy's 32 or more
    #: connections), a store call's answer waits behind them past the store deadline, every
    #: check fails open and the breaker opens, i.e. the limiters switch off exactly when the
    #: server is overloaded. Bounded, the wait moves before the check (Envoy's ext_authz
    #: timeout bounds it) and the store deadline measures the store. Chosen by measurement
    #: (docs/http.md).
    max_active_checks: int = DEFAULT_MAX_ACTIVE_CHECKS


#: headers the gRPC edge reads whatever the policy says (``server/edge.py``: the request id
#: that pairs a Check with its access-log entry). The trace parent arrives in the Check call's
#: gRPC metadata, the client address, the route's tier and the JWT payload in attributes.
GRPC_EDGE_HEADERS = (REQUEST_ID_HEADER,)


def allowed_headers(needed: Iterable[str], protocol: str = "http") -> list[str]:
    """What the ext_authz filter's ``allowed_headers`` must list for a policy that reads
    ``needed`` (``Policy.needed_headers``): those, then the ones the edge of ``protocol``
    reads (``extauthz envoy-allowed-headers``). The HTTP protocol leaves out the headers Envoy
    always sends an HTTP service; the gRPC protocol sends nothing it does not list (an unset
    list sends every header), so Authorization stays in its list."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    implied = ALWAYS_SENT if protocol == "http" else frozenset()
    edge = EDGE_HEADERS if protocol == "http" else GRPC_EDGE_HEADERS
    out = [h for h in sorted({h.lower() for h in needed}) if h not in implied]
    return out + [h for h in edge if h not in out]


# ---- the request: HTTP -> RawRequest ----------------------------------------------------


def source_ip(forwarded_for: str) -> str:
    """The last ``x-forwarded-for`` entry: the address Envoy saw (Envoy appends it with
    ``use_remote_address: true``; entries before it are the client's own claims)."""
    if not forwarded_for:
        return ""
    return forwarded_for.rpartition(",")[2].strip()


def _split_quoted(text: str, sep: str) -> list[str]:
    out, cur, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            cur.append(ch)
            escaped = False
        elif ch == "\\" and quoted:
            cur.append(ch)
            escaped = True
        elif ch == '"':
            quoted = not quoted
            cur.append(ch)
        elif ch == sep and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def xfcc_principal(value: str) -> str:
    """The ``URI=`` of the last element of an ``x-forwarded-client-cert`` header: the peer
    Envoy itself authenticated (with ``SANITIZE_SET`` it is the only element; with
    ``APPEND_FORWARD`` earlier elements are what further proxies claimed). Empty if none."""
    if not value:
        return ""
    last = _split_quoted(value, ",")[-1]
    for pair in _split_quoted(last, ";"):
        key, eq, val = pair.partition("=")
        if eq and key.strip().lower() == "uri":
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] == '"':
                val = val[1:-1].replace('\\"', '"')
            return val
    return ""


def jwt_payload(value: str) -> dict[str, Any] | None:
    """The JSON object ``jwt_authn`` forwards (base64url, padding optional), or None."""
    if not value or len(value) > 16 * 1024:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (ValueError, binascii.Error):
        return None
    return data if isinstance(data, dict) else None


def _scalar(value: object) -> str | float | bool | None:
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value)  # as a protobuf Struct (the gRPC protocol's metadata) holds numbers
    return None


def dict_paths(data: Mapping[str, Any], paths: Iterable[Sequence[str]]) -> dict[str, Any]:
    """Only the scalars at ``paths`` of nested dicts, as nested dicts: the same shape the gRPC
    edge extracts from a metadata Struct (``edge.struct_paths``)."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = data
        into = out
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, Mapping) else None
            if not isinstance(node, Mapping):
                break
            sub = into.setdefault(key, {})
            if not isinstance(sub, dict):
                break
            into = sub
        else:
            if path and isinstance(node, Mapping):
                scalar = _scalar(node.get(path[-1]))
                if scalar is not None:
                    into[path[-1]] = scalar
    return out


def http_metadata(headers: Mapping[str, str],
                  needed: Mapping[str, Sequence[Sequence[str]]]) -> dict[str, Any]:
    """The authenticated metadata the HTTP protocol carries, keyed by namespace like the gRPC
    protocol's ``metadata_context``: the JWT payload ``jwt_authn`` forwarded
    (``forward_payload_header``), filed as ``payload_in_metadata: payload`` would file it."""
    paths = needed.get(JWT_NAMESPACE)
    if not paths or JWT_PAYLOAD_HEADER not in headers:
        return {}
    payload = jwt_payload(headers[JWT_PAYLOAD_HEADER])
    if payload is None:
        return {}
    return {JWT_NAMESPACE: dict_paths({JWT_PAYLOAD_KEY: payload}, paths)}


def path_prefix(value: str) -> str:
    """``--http-path-prefix``: ``""`` (none) or ``/seg[/seg...]`` without a trailing slash."""
    prefix = value.rstrip("/")
    if prefix and (not prefix.startswith("/") or any(c in prefix for c in "?#") or " " in prefix):
        raise ValueError(f"an HTTP path prefix is a path such as /auth, not {value!r}")
    return prefix


def client_path(path: str, prefix: str) -> str:
    """The client's path from the one Envoy sent: ``http_service.path_prefix`` (Envoy Gateway's
    SecurityPolicy ``extAuth.http.path``) + the client's path. A path without the prefix (or
    where it is only the start of a longer segment, ``/authors`` for ``/auth``) is the client's."""
    if prefix and path.startswith(prefix):
        rest = path[len(prefix):]
        if not rest or rest[0] == "/":
            return rest or "/"
    return path


def raw_request(method: str, target: str, headers: Mapping[str, str],
                needed: Iterable[str], *, forward_auth: bool = False, prefix: str = "",
                metadata: Mapping[str, Sequence[Sequence[str]]] = _NO_METADATA) -> RawRequest:
    """The HTTP authorization request as the engine sees it (the one conversion).

    ``metadata``: the namespaces and paths the policy reads (``Classifier.needed_metadata``):
    only the forwarded JWT payload is decoded, and only when the policy reads it.
    ``prefix``: the ``path_prefix`` Envoy puts before the client's path (:func:`client_path`).
    ``forward_auth``: the proxy sends every check as ``GET <its address>`` and the client's
    request in ``X-Forwarded-Method`` / ``X-Forwarded-Uri`` / ``X-Forwarded-Host`` (Traefik's
    ForwardAuth); only for proxies that set those themselves (never for Envoy, which sends the
    client's method and path as they are).
    """
    if forward_auth:
        method = headers.get("x-forwarded-method", method)
        target = headers.get("x-forwarded-uri", target)
        host = headers.get("x-forwarded-host")
        if host is not None:
            headers = {**headers, "host": host}
    q = target.find("?")
    path = target[:q] if q >= 0 else target
    if prefix:
        path = client_path(path, prefix)
    return RawRequest(
        method=method,
        path=path,
        host=headers.get("host", ""),
        headers={h: headers[h] for h in needed if h in headers},
        source_ip=source_ip(headers.get(FORWARDED_FOR_HEADER, "")),
        route_tier=headers.get(ROUTE_TIER_HEADER),
        context_extensions=_EMPTY,
        request_id=headers.get(REQUEST_ID_HEADER, ""),
        metadata=http_metadata(headers, metadata) if metadata else _EMPTY,
        principal=xfcc_principal(headers.get(XFCC_HEADER, "")),
    )


# ---- the answer: Decision -> HTTP ------------------------------------------------------


def _head(status: int, headers: Iterable[tuple[str, str]], length: int, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, _REASONS.get(status, b"Refused"), length)]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def http_answer(ctx: RequestContext, decision: Decision, *, close: bool = False, ticket: str = "") -> bytes:
    """The whole HTTP/1.1 response for a decision, from the same pieces as the gRPC answer:
    allowed -> 200 with the tier header (for the upstream), the RateLimit headers (for the
    client) and the lease fields (for Envoy's dynamic metadata); refused -> the denial's
    status (503 as :data:`SHED_STATUS`), headers and problem+json body."""
    if decision.allowed:
        headers = [(TIER_HEADER, ctx.tier.value), *ratelimit_headers(decision), *lease_fields(decision, ticket)]
        return _head(200, headers, 0, close)
    d = denial(ctx, decision)
    body = d.body.encode()
    status = SHED_STATUS if d.status == 503 else d.status
    return _head(status, d.headers, len(body), close) + body


def _error_answer(status: int) -> bytes:
    return _head(status, (), 0, True)


# ---- the server -------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class HttpAuthorization:
    """The HTTP front door: one per server, sharing the gRPC servicer's engine, request-id
    index and lease bookkeeping (:class:`AuthorizationService`)."""

    def __init__(self, service: AuthorizationService, limits: HttpLimits | None = None,
                 tracer: Any = None, *, forward_auth: bool = False, prefix: str = "") -> None:
        self.service = service
        self.forward_auth = forward_auth
        #: ``--http-path-prefix`` (normalized by :func:`path_prefix`)
        self.prefix = path_prefix(prefix)
        self.limits = limits if limits is not None else HttpLimits()
        self.tracer = tracer
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections: set[_Connection] = set()
        #: answered with a 4xx or closed for a protocol reason, by reason.
        self.rejected: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        #: bounds the checks decided at once (:attr:`HttpLimits.max_active_checks`)
        self.active = asyncio.Semaphore(self.limits.max_active_checks)

    def status(self) -> dict[str, Any]:
        """The ``http`` section of the admin ``/status``."""
        return {"port": self.port, "connections": len(self.connections),
                "max_connections": self.limits.max_connections,
                "rejected": dict(sorted(self.rejected.items()))}

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    async def start(self, listen: str, *, reuse_port: bool = False) -> int:
        host, port = parse_listen(listen)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                               reuse_port=reuse_port or None, backlog=1024)
        self.port = int(self.server.sockets[0].getsockname()[1])
        self._sweeper = asyncio.create_task(self._sweep(), name="extauthz-http-sweeper")
        return self.port

    async def _sweep(self) -> None:
        """Header timeouts and idle connections, checked once a second (no timer per request)."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        while True:
            await asyncio.sleep(min(1.0, limits.header_timeout / 2))
            now = loop.time()
            for conn in list(self.connections):
                conn.expire(now, limits)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let answers in progress finish (up to ``grace`` s), then close."""
        if self.server is None:
            return
        self.server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        answering = [c.task for c in self.connections if c.task is not None]
        if answering:
            await asyncio.wait(answering, timeout=grace)
        for conn in list(self.connections):
            conn.close()
        self.server = None


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue (in order), decide, answer."""

    def __init__(self, front: HttpAuthorization) -> None:
        self.front = front
        self.limits = front.limits
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        #: the answers of this loop turn, written together at the start of the next
        self.out: Cork | None = None
        self.queue: deque[tuple[str, str, dict[str, str], bool]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.last_active = self.loop.time()
        self.header_started: float | None = None
        self.paused = False
        self.write_paused = False
        #: a protocol error was met: the answers owed are sent, then the connection closed;
        #: bytes arriving meanwhile are read and dropped unparsed (not left unread: closing
        #: with unread bytes resets the connection, which can destroy the answers in flight)
        self.failed = False
        self.closed = False
        # the request being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._size = 0
        self._count = 0

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = Cork(transport, self.loop)
        if len(self.front.connections) >= self.limits.max_connections:
            self.front.reject("too_many_connections")
            self.closed = True
            transport.close()
            return
        self.front.connections.add(self)
        # the first request's headers are due within header_timeout of the connection (a
        # client that connects and never speaks would otherwise hold it for idle_timeout)
        self.header_started = self.last_active

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.out is not None:
            self.out.drop()
        self.front.connections.discard(self)

    def pause_writing(self) -> None:  # the client is not reading our answers
        self.write_paused = True
        self._pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if len(self.queue) < self.limits.max_pipelined:
            self._resume()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.failed:
            return
        self.last_active = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # the check itself was read and is answered; what follows is not HTTP/1.1
            self._fail(0, "upgrade")
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._fail(cause.status, "headers_too_large")
            else:  # a bug of ours: answered and logged, the server goes on
                log.error("HTTP request handling failed", exc_info=cause or exc)
                self._fail(500, "internal")
        except httptools.HttpParserError:
            self._fail(400, "bad_request")

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._size = 0
        self._count = 0
        self.header_started = self.last_active

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._size += len(url)
        if self._size > self.limits.max_header_bytes:
            raise _Refused(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value) + 4
        self._count += 1
        if self._size > self.limits.max_header_bytes or self._count > self.limits.max_headers:
            raise _Refused(431)
        headers = self._headers
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        prior = headers.get(key)
        # repeated headers joined with "," as Envoy joins them in a gRPC CheckRequest, so one
        # client is one identity on either front door
        headers[key] = text if prior is None else f"{prior},{text}"

    def on_headers_complete(self) -> None:
        self.header_started = None
        parser = self.parser
        self.queue.append((parser.get_method().decode("latin-1"), self._url.decode("latin-1"),
                           self._headers, bool(parser.should_keep_alive())))
        self._headers = {}
        if len(self.queue) >= self.limits.max_pipelined:
            self._pause()
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    # -- answering, in arrival order
    async def _serve(self) -> None:
        front = self.front
        service = front.service
        queue = self.queue
        try:
            while queue and not self.closed:
                method, target, headers, keep_alive = queue[0]
                try:
                    async with front.active:
                        answer = await self._answer(service, method, target, headers, keep_alive)
                except Exception:  # a bug of ours: Envoy fails open on a 5xx; the server goes on
                    log.exception("HTTP authorization failed")
                    front.reject("internal")
                    answer, keep_alive = _error_answer(500), False
                queue.popleft()
                out = self.out
                if out is None or self.closed:
                    break
                # corked: the answers of this turn in one write, now if no request waits
                out.write(answer, last=not queue)
                if not keep_alive:
                    self.close()
                    break
                if self.paused and len(queue) < self.limits.max_pipelined // 2 and not self.write_paused:
                    self._resume()
        finally:
            self.task = None
            self.last_active = self.loop.time()

    async def _answer(self, service: AuthorizationService, method: str, target: str,
                      headers: dict[str, str], keep_alive: bool) -> bytes:
        engine = service.engine
        snap = engine.snapshot
        try:
            raw = raw_request(method, target, headers, snap.classifier.needed_headers,
                              forward_auth=self.front.forward_auth, prefix=self.front.prefix,
                              metadata=snap.classifier.needed_metadata)
            ctx = snap.classifier.context(raw)
        except Exception as exc:  # decided safely: allowed, counted (as the gRPC edge does)
            service.bad_request("an HTTP authorization request", exc)
            return _head(200, (), 0, not keep_alive)
        tracer = self.front.tracer
        if tracer is None:
            decision = await engine.decide(ctx)
        else:
            decision = await self._traced(tracer, ctx, headers)
        ticket = ""
        if decision.leases:
            if self.closed:  # Envoy gave up on this check: the answer, and its leases, are lost
                service.abandoned(decision)
            else:
                ticket = service.admitted(ctx, decision)
        return http_answer(ctx, decision, close=not keep_alive, ticket=ticket)

    async def _traced(self, tracer: Any, ctx: RequestContext, headers: Mapping[str, str]) -> Decision:
        from opentelemetry.trace import SpanKind

        from ..observe.tracing import CHECK_SPAN, parent_context

        carrier = [(k, headers[k]) for k in ("traceparent", "tracestate") if k in headers]
        with tracer.start_as_current_span(CHECK_SPAN, context=parent_context(carrier),
                                          kind=SpanKind.SERVER, attributes=_HTTP_SPAN):
            return await self.front.service.engine.decide(ctx)

    # -- flow control and errors
    def _pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _fail(self, status: int, reason: str) -> None:
        """Answer a protocol error (status 0: none) after the answers already owed, then close."""
        self.header_started = None
        if self.transport is None or self.closed or self.failed:
            return
        self.failed = True
        self.front.reject(reason)
        if self.task is None:
            self._fail_now(status)
        else:  # answers owed first: queue the error behind them
            self.task.add_done_callback(lambda _: self._fail_now(status))

    def _fail_now(self, status: int) -> None:
        if status and self.out is not None and not self.closed:
            self.out.write(_error_answer(status))
        self.close()

    def expire(self, now: float, limits: HttpLimits) -> None:
        if self.header_started is not None and now - self.header_started > limits.header_timeout:
            self._fail(408, "header_timeout")
        elif self.task is None and not self.queue and now - self.last_active > limits.idle_timeout:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            if self.out is not None:
                self.out.flush()  # the answers owed go first; close() sends them, then FIN
            self.transport.close()


_HTTP_SPAN = {"network.protocol.name": "http", "extauthz.protocol": "http"}
