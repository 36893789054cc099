"""The HTTP authorization port (Envoy's ``http_service``): the protocol and its limits, on a
small asyncio protocol. A thin front door of the check flow (``server/flow.py``): requests are
read into ``server/httpmap.py``'s mapping and answered from it; this module only parses,
queues, bounds and writes.

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
waiting per connection (reading pauses; bytes already read are parsed :data:`FEED_BYTES` at a
time and the rest kept unparsed until the queue drains, so one read of many pipelined
requests cannot queue them all), and a client that does not read our answers gets no more:
once its write buffer passes ``max_write_buffer`` its answers wait (and so does reading) until
it reads, and if it has not read within ``header_timeout`` the connection is aborted
(``not_reading``). The request body is never kept.

Fair service across connections: a connection answers at most :data:`TURN_ANSWERS` requests
per loop turn, then yields, so a connection pipelining many requests shares the loop with the
others instead of holding it (on the embedded store a check never suspends: without the
yield one connection's queue ran to its end in one turn, and 20 such connections kept every
other one waiting for seconds; docs/http.md "Bounds").

Answers are corked (:class:`~extauthz.core.cork.Cork`): the answers one loop turn produces on a
connection (pipelined requests) go out in one socket write, in order: at once when no request
waits behind the last of them, else at the start of the next turn; closing a connection writes
what is held first.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httptools

from ..core import settings
from ..core.context import RawRequest, RequestContext
from ..core.cork import Cork
from ..core.verdict import Decision
from ..engine.engine import Snapshot
from ..envoy.headers import TRACE_HEADERS
from .flow import CheckFlow
from .httpmap import error_answer, head, http_answer, raw_request
from .leases import Leases, seen_as
from .ports import parse_listen

log = logging.getLogger("extauthz.server")

#: a request as the connection queues it: method, target, headers, keep-alive
Request = tuple[str, str, dict[str, str], bool]
_HTTP_SPAN = {"network.protocol.name": "http", "extauthz.protocol": "http"}
#: requests one connection answers per loop turn before it lets the others run
TURN_ANSWERS = 16
#: bytes handed to the parser at a time; between pieces it stops once ``max_pipelined``
#: requests wait (a piece holds at most ~110 requests of the smallest size)
FEED_BYTES = 2048


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
    #: bytes of answers a connection may hold unsent (its client is not reading) before its
    #: answers, and its reading, wait (the transport's high-water mark; low is a quarter).
    max_write_buffer: int = 64 * 1024
    #: each connection's socket send buffer (``SO_SNDBUF``; Linux doubles it): what the kernel
    #: holds for a client that does not read, instead of its autotuned up to 4 MiB. Answers
    #: are a few hundred bytes: this is many round trips' worth.
    send_buffer: int = 64 * 1024
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


# ---- the server -------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class HttpAuthorization:
    """The HTTP front door: one per server, a :class:`~extauthz.server.flow.Door` of the
    server's check flow (the same flow, engine and lease owner as the gRPC servicer)."""

    name = "http"
    what = "an HTTP authorization request"
    span = _HTTP_SPAN

    def __init__(self, flow: CheckFlow, limits: HttpLimits | None = None, *,
                 forward_auth: bool = False, prefix: str = "") -> None:
        self.flow = flow
        self.forward_auth = forward_auth
        #: ``--http-path-prefix`` (normalized by :func:`~extauthz.core.settings.path_prefix`)
        self.prefix = settings.path_prefix(prefix)
        self.limits = limits if limits is not None else HttpLimits()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections: set[_Connection] = set()
        #: answered with a 4xx or closed for a protocol reason, by reason.
        self.rejected: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        #: bounds the checks decided at once (:attr:`HttpLimits.max_active_checks`)
        self.active = asyncio.Semaphore(self.limits.max_active_checks)

    # -- the Door: a queued request in, HTTP/1.1 bytes out
    def read(self, message: Request, snap: Snapshot) -> RawRequest:
        return raw_request(message[0], message[1], message[2], snap.classifier.needed_headers,
                           forward_auth=self.forward_auth, prefix=self.prefix,
                           metadata=snap.classifier.needed_metadata)

    def hold(self, message: Request, call: _Connection, ctx: RequestContext, decision: Decision,
             leases: Leases) -> str | None:
        if call.closed:  # Envoy gave up on this check
            return None
        return seen_as(ctx.method, ctx.path)  # the HTTP protocol carries no start time

    def answer(self, message: Request, ctx: RequestContext, decision: Decision, ticket: str) -> bytes:
        return http_answer(ctx, decision, close=not message[3], ticket=ticket)

    def time_left(self, message: Request, call: _Connection) -> tuple[float | None, float, bool]:
        # Envoy's HTTP call carries no deadline; the wait is since the connection's last
        # bytes arrived (queue time behind max_active_checks included)
        return None, call.loop.time() - call.last_active, False

    def unreadable(self, message: Request) -> bytes:
        return head(200, (), 0, not message[3])

    def carrier(self, message: Request, call: _Connection) -> Iterable[tuple[str, Any]]:
        headers = message[2]
        return [(k, headers[k]) for k in TRACE_HEADERS if k in headers]

    def status(self) -> dict[str, Any]:
        """The ``http`` section of the admin ``/status``."""
        paused = not_reading = buffered = queued = unparsed = 0
        for conn in self.connections:
            paused += conn.paused
            not_reading += conn.write_paused
            buffered = max(buffered, conn.write_buffered())
            queued = max(queued, len(conn.queue))
            unparsed = max(unparsed, len(conn.unparsed) - conn.unparsed_at)
        return {"port": self.port, "connections": len(self.connections),
                "max_connections": self.limits.max_connections,
                "rejected": dict(sorted(self.rejected.items())),
                # connections not being read (their client does not read our answers, or
                # max_pipelined requests wait), those whose answers wait for their client to
                # read, and the most any one connection holds
                "paused_reading": paused, "answers_paused": not_reading, "max_write_buffer_bytes": buffered,
                "max_queued_requests": queued, "max_unparsed_bytes": unparsed}

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
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.last_active = self.loop.time()
        self.header_started: float | None = None
        self.paused = False
        self.write_paused = False
        self.write_paused_since = 0.0
        #: set while :meth:`_serve` waits for the client to read (``resume_writing``)
        self._writable: asyncio.Future[None] | None = None
        #: bytes read and not yet parsed (from ``unparsed_at``): parsing waits while
        #: ``max_pipelined`` requests do
        self.unparsed = b""
        self.unparsed_at = 0
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
        transport.set_write_buffer_limits(self.limits.max_write_buffer)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer)
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
        self.unparsed = b""
        self._wake()
        self.front.connections.discard(self)

    def pause_writing(self) -> None:  # the client is not reading our answers
        self.write_paused = True
        self.write_paused_since = self.loop.time()
        self._pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()
        if len(self.queue) < self.limits.max_pipelined:
            self._resume()

    def write_buffered(self) -> int:
        """Bytes of answers written and not yet taken by the client's socket."""
        transport = self.transport
        return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.failed:
            return
        self.last_active = self.loop.time()
        if self.unparsed_at < len(self.unparsed):  # arrived before the pause took effect
            self.unparsed = self.unparsed[self.unparsed_at:] + data
        else:
            self.unparsed = data
        self.unparsed_at = 0
        self._parse()

    def _parse(self) -> None:
        """Parse what was read, :data:`FEED_BYTES` at a time, until ``max_pipelined``
        requests wait; what is left stays in :attr:`unparsed` (reading is paused)."""
        data, at, limit = self.unparsed, self.unparsed_at, self.limits.max_pipelined
        view = memoryview(data)
        try:
            while at < len(data) and len(self.queue) < limit and not self.failed:
                piece = view[at:at + FEED_BYTES]
                at += len(piece)
                self.parser.feed_data(piece)
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
        finally:
            if at >= len(data) or self.failed:
                self.unparsed, self.unparsed_at = b"", 0
            else:
                self.unparsed_at = at

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
        check = front.flow.check
        queue = self.queue
        turn = 0
        try:
            while queue and not self.closed:
                if self.write_paused:  # the client is not reading: its answers wait
                    self._writable = self.loop.create_future()
                    await self._writable
                    continue
                if turn >= TURN_ANSWERS:  # let the other connections run
                    turn = 0
                    await asyncio.sleep(0)
                    continue
                turn += 1
                request = queue[0]
                keep_alive = request[3]
                try:
                    async with front.active:
                        answer = await check(front, request, self)
                except Exception:  # a bug of ours: Envoy fails open on a 5xx; the server goes on
                    log.exception("HTTP authorization failed")
                    front.reject("internal")
                    answer, keep_alive = error_answer(500), False
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

    # -- flow control and errors
    def _pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if not self.paused or self.transport is None or self.closed:
            return
        if self.unparsed:  # what was read first
            self._parse()
            if self.unparsed or len(self.queue) >= self.limits.max_pipelined or self.closed:
                return
        self.paused = False
        self.transport.resume_reading()

    def _wake(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

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
            self.out.write(error_answer(status))
        self.close()

    def expire(self, now: float, limits: HttpLimits) -> None:
        if self.write_paused and now - self.write_paused_since > limits.header_timeout:
            # its answers have waited for it to read for as long as a request's headers may
            # take: what it holds is dropped (Envoy reads each answer within its timeout)
            self.front.reject("not_reading")
            self.abort()
        elif self.unparsed and not self.write_paused:
            # parsing waits for our answers, not for the client: its clock restarts
            if self.header_started is not None:
                self.header_started = now
        elif self.header_started is not None and now - self.header_started > limits.header_timeout:
            self._fail(408, "header_timeout")
        elif self.task is None and not self.queue and now - self.last_active > limits.idle_timeout:
            self.close()

    def abort(self) -> None:
        """Close at once, dropping what is unsent (a client that does not read would keep a
        graceful close waiting for its buffer to drain)."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self._wake()
            if self.out is not None:
                self.out.drop()
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self._wake()
            if self.out is not None:
                self.out.flush()  # the answers owed go first; close() sends them, then FIN
            self.transport.close()
