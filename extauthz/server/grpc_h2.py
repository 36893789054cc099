"""The gRPC port served on the event loop (what ``serve`` runs; ``--grpc-server grpcio``
selects grpc.aio instead for one release).

grpc.aio answers a no-op ``Check`` at ~395 us of CPU, most of it system calls and hand-offs
between gRPC's poller thread and the event loop (docs/design.md, "The gRPC front door"). This
server runs HTTP/2 on the event loop itself: ``server/h2conn.py``, the connection written by
hand (preface, SETTINGS, stream states, CONTINUATION, padding, PRIORITY, PING, stream ids,
frame and header-list sizes, flow-control windows; the ``hpack`` library decodes request
headers), tells this module what it read; this module adds what gRPC and a server exposed to
a network need on top, each bounded (:class:`H2Limits`, docs/security.md
"HTTP/2 bounds"):

* gRPC framing of messages (5-byte prefix), a message size bound (RESOURCE_EXHAUSTED),
  compressed messages refused (only ``identity`` is offered), ``grpc-timeout`` as the call's
  deadline, unknown methods UNIMPLEMENTED, trailers with ``grpc-status``/``grpc-message``;
* concurrency counted on the calls still running (a reset stream's handler counts until it
  ends), so rapid reset (CVE-2023-44487) cannot pile up work; peer resets
  and every frame that makes no progress (PING, SETTINGS, PRIORITY, small WINDOW_UPDATEs,
  empty DATA, ...: :meth:`_Connection.inspect`) drawn from budgets that refill with time: a
  flood gets GOAWAY ENHANCE_YOUR_CALM; a header block's encoded bytes bounded before decoding;
* inbound flow control tied to consumption: a stream's window is reopened only while what this
  connection holds unconsumed stays under ``max_buffered`` (a slow access-log handler slows
  Envoy's stream, not our memory); outbound data waits for the peer's windows and the socket:
  a peer that stops reading is closed once ``max_write_buffer`` bytes wait for it;
* a handshake and an idle timeout, and a unary request's body due within ``request_timeout``;
* every call shape: unary, server streaming (health Watch), client streaming (the access
  log), bidirectional (the rate limit quota stream);
* graceful stop: GOAWAY, running calls finish (up to the grace), request streams (the access
  log, the quota stream) are ended cleanly and answered, the rest cancelled; connections close
  once their clients closed those streams (within ``close_linger``);
* every bound counted (:meth:`GrpcH2Server.metrics`).

The common answer (one message, ``grpc-status`` 0) is written as three frames of constant
header blocks in one piece (:meth:`_Connection._answer`; docs/design.md, "The gRPC port on the
event loop").

The servicers are the ones grpc.aio runs (``server/services.py``, grpc_health's servicer):
``add_*Servicer_to_server`` registers them here too, and each call gets a :class:`Call`, the
part of ``grpc.aio.ServicerContext`` they use. The check flow (``server/flow.py``) thus runs
behind the same gRPC door adapter whichever server carries it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any
from urllib.parse import quote

import grpc
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..core.settings import DEFAULT_MAX_ACTIVE_CHECKS
from ..core.throttle import LogThrottle
from ..engine.overload import margin
from .h2conn import (
    CODE_NAMES,
    CONTINUATION,
    DATA,
    GOAWAY,
    HEADERS,
    PING,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ErrorCode,
    H2Conn,
    H2Error,
    Stream,
    encode_headers,
)
from .ports import parse_listen

__all__ = ["Call", "GrpcH2Server", "H2Limits", "Slots", "call_time_left", "malformed", "parse_timeout"]

log = logging.getLogger("extauthz.server")

OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED = 0, 1, 2, 4
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
#: the answer's header blocks as constant bytes that touch no HPACK table (``:status`` 200
#: from the static table; content-type and grpc-status 0 literal, never indexed), for the fast
#: path of :meth:`_Connection._send_out`
_HEAD_BLOCK = b"\x88\x0f\x10\x10application/grpc"
_OK_BLOCK = b"\x00\x0bgrpc-status\x010"
_OK = [(b"grpc-status", b"0")]

#: a request's pseudo-header fields (RFC 9113 8.3.1; a gRPC call is never a CONNECT) and the
#: connection-specific fields it must not carry (8.2.2), for :func:`malformed`
_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_REQUIRED_PSEUDO = frozenset((b":method", b":scheme", b":path"))
_CONNECTION_FIELDS = frozenset((b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding",
                                b"upgrade"))
#: a regular field name: no 0x00-0x20, no uppercase 0x41-0x5a, no 0x7f-0xff, no colon (8.2.1)
_FIELD_NAME = re.compile(rb"[\x21-\x39\x3b-\x40\x5b-\x7e]+").fullmatch
#: a field value with NUL, CR or LF, or whitespace at either end (8.2.1)
_BAD_VALUE = re.compile(rb"[\x00\n\r]|\A[ \t]|[ \t]\Z").search
#: every regular field name of a request joined by spaces (never in a valid name: a name
#: holding one adds to their count), for :func:`_well_formed`: one match for them all
_FIELD_NAMES = re.compile(rb"[\x21-\x39\x3b-\x40\x5b-\x7e]+(?: [\x21-\x39\x3b-\x40\x5b-\x7e]+)*").fullmatch
#: a value's first or last byte that makes it malformed (a tuple: b"" is in b" \t", not in it)
_BLANKS = (b" ", b"\t")


def _well_formed(headers: list[tuple[bytes, bytes]]) -> bool:
    """True only if :func:`malformed` finds nothing in a request's header list: its rules
    checked over the whole list at once (names joined into one match, values joined by LF and
    searched with ``in``: a few C calls instead of two patterns per field, 9 % of a no-op
    check's Python time). False may still be well formed: :func:`malformed` then decides."""
    n = 0
    for name, _ in headers:
        if name[:1] != b":":
            break
        n += 1
    pseudo = dict(headers[:n])
    if (len(pseudo) != n or not _REQUIRED_PSEUDO <= pseudo.keys() <= _PSEUDO or not pseudo[b":path"]
            or pseudo[b":method"] == b"CONNECT"):
        return False
    names = [name for name, _ in headers[n:]]
    joined = b" ".join(names)
    if (_FIELD_NAMES(joined) is None or joined.count(b" ") != len(names) - 1
            or not _CONNECTION_FIELDS.isdisjoint(names)):
        return False
    values = b"\n".join([value for _, value in headers])
    if (values.count(b"\n") != len(headers) - 1 or b"\0" in values or b"\r" in values
            or b"\n " in values or b"\n\t" in values or b" \n" in values or b"\t\n" in values
            or values[:1] in _BLANKS or values[-1:] in _BLANKS):
        return False
    if b"te" in names and (names.count(b"te") > 1
                           or headers[n + names.index(b"te")][1].lower() != b"trailers"):
        return False
    authority = pseudo.get(b":authority")
    if b"host" not in names:
        return authority is not None
    host = headers[n + names.index(b"host")][1]
    return names.count(b"host") == 1 and (authority is None or authority == host)


def malformed(headers: Iterable[tuple[bytes, bytes]], trailers: bool = False) -> str | None:
    """Why a request's header list (or with ``trailers``, its trailer list) is malformed
    (RFC 9113 8.1.1: a stream error), or None.

    What h2's inbound header validation checked (its ``validate_inbound_headers``, when this
    server ran on h2), in one pass with two compiled patterns per field instead of h2's generator chain
    that walks every byte of every name and value in Python: 27 % of a no-op check's
    instructions (docs/design.md, "The gRPC port on the event loop"). Trailers carry no
    pseudo-header field and need none (8.1)."""
    if not trailers and type(headers) is list and _well_formed(headers):
        return None
    seen: set[bytes] = set()
    regular = connect = False
    host = authority = None
    for name, value in headers:
        if name[:1] == b":":
            if trailers:
                return f"pseudo-header field {name!r} in trailers"
            if regular:
                return f"pseudo-header field {name!r} after a regular field"
            if name not in _PSEUDO:
                return f"pseudo-header field {name!r} not of a request"
            if name in seen:
                return f"duplicate pseudo-header field {name!r}"
            seen.add(name)
            if name == b":authority":
                authority = value
            elif name == b":path" and not value:
                return "empty :path"
            elif name == b":method":
                connect = value == b"CONNECT"
        else:
            regular = True
            if _FIELD_NAME(name) is None:
                return f"bad field name {name!r}"
            if name in _CONNECTION_FIELDS:
                return f"connection-specific field {name!r}"
            if name == b"te" and value.lower() != b"trailers":
                return "te other than trailers"
            if name == b"host":
                if host is not None:
                    return "more than one host field"
                host = value
        if value and _BAD_VALUE(value) is not None:
            return f"bad value of {name!r}"
    if trailers:
        return None
    if not seen >= _REQUIRED_PSEUDO:
        return f"missing {b', '.join(sorted(_REQUIRED_PSEUDO - seen))!r}"
    if connect:  # a CONNECT must omit :scheme and :path (8.5)
        return "CONNECT with :scheme and :path"
    if authority is None and host is None:
        return "neither :authority nor host"
    if authority is not None and host is not None and authority != host:
        return ":authority and host differ"
    return None


#: the reasons :meth:`GrpcH2Server.reject` counts, by what each ended (the ``extauthz_grpc_*``
#: metrics; docs/operations.md): a connection closed before it served a call, ...
CONNECTION_REFUSED = ("too_many_connections", "stopping", "alpn", "handshake_timeout", "tls_handshake",
                      "handshake_error")
#: ... a connection ended by a bound or a protocol error, ...
CONNECTION_CLOSED = ("frame_too_large", "protocol_error", "control_flood", "rapid_reset", "slow_frame",
                     "peer_not_reading", "idle_timeout")
#: ... one stream reset (refused, malformed, timed out; or reset by the peer before its answer)
STREAM_RESET = ("too_many_streams", "after_goaway", "malformed_request", "message_too_large",
                "request_timeout", "reset_by_peer")
#: ... and a unary call whose deadline neared before a max_active_calls slot was free (run
#: without one, told no time is left)
CALL_LATE = ("no_slot_in_time",)
#: the GOAWAY error codes this server sends, exported from 0
GOAWAY_CODES = ("NO_ERROR", "PROTOCOL_ERROR", "FLOW_CONTROL_ERROR", "FRAME_SIZE_ERROR", "COMPRESSION_ERROR",
                "ENHANCE_YOUR_CALM")


@dataclass(frozen=True)
class H2Limits:
    """The bounds of the gRPC port (docs/security.md, "HTTP/2 bounds")."""

    #: calls running at once per connection (SETTINGS_MAX_CONCURRENT_STREAMS, and the count of
    #: handlers still running: one more stream is refused with REFUSED_STREAM)
    max_concurrent_streams: int = 100
    #: SETTINGS_MAX_FRAME_SIZE we accept (the protocol's minimum)
    max_frame_size: int = 16384
    #: SETTINGS_MAX_HEADER_LIST_SIZE: decoded request headers (HPACK bombs end here)
    max_header_list_size: int = 16384
    #: SETTINGS_HEADER_TABLE_SIZE: the HPACK dynamic table the peer may use
    header_table_size: int = 4096
    #: one gRPC message (grpc's own default receive bound): more is RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 << 20
    #: SETTINGS_INITIAL_WINDOW_SIZE of each stream, and the connection's window
    stream_window: int = 1 << 20
    connection_window: int = 16 << 20
    #: request bytes held unconsumed per connection past which windows stay shut
    max_buffered: int = 16 << 20
    #: answer bytes the peer has not read past which the connection is closed
    max_write_buffer: int = 4 << 20
    #: a connection being closed gives a peer that does not read this long (s) to take what
    #: is still queued for it, then it is aborted (its socket freed); error paths abort at once
    close_linger: float = 2.0
    #: the client preface and SETTINGS are due within this of the connection (s)
    handshake_timeout: float = 10.0
    #: a connection with no call running and none ended for this long is closed (GOAWAY) (s);
    #: PINGs and other frames do not count as activity
    idle_timeout: float = 600.0
    #: a unary call's request must be complete within this of its headers, and a frame or
    #: header block within this of its first byte (s)
    request_timeout: float = 10.0
    #: open connections at once; one more is closed at once
    max_connections: int = 4096
    #: streams a peer may reset before their answer, per second (burst: twice as many)
    resets_per_second: float = 200.0
    #: frames that make no progress a peer may send per second (burst: twice): PING, SETTINGS
    #: (ACKs too), PRIORITY, GOAWAY, unknown types, WINDOW_UPDATE under 1 KiB or that nothing
    #: waits on, DATA without data or END_STREAM, DATA on a stream no call has (CVE-2019-9512,
    #: -9513, -9515, -9518); past it GOAWAY ENHANCE_YOUR_CALM
    control_per_second: float = 100.0
    #: unary calls (Check) decided at once, over all connections; more wait their turn before
    #: their handler starts, their deadline counting (the HTTP port's ``max_active_checks``,
    #: for the same reason: unbounded, a saturated loop ran every check Envoy had in flight
    #: at once and their store calls waited in this server past the store deadline: 6-9 % of
    #: the checks failed open in the harness's (r-h2) and (d-h2) rows, the breaker opened);
    #: a call whose deadline less Envoy's margin comes before a slot runs without one, told
    #: no time is left (``no_slot_in_time``: decided without the store, counted)
    max_active_calls: int = DEFAULT_MAX_ACTIVE_CHECKS

    def __post_init__(self) -> None:
        # what a peer may send before it reads our SETTINGS (RFC 9113 6.5.3, 6.9.2): a stream
        # window below the protocol's initial 65,535 would be a FLOW_CONTROL_ERROR of an
        # honest client's first request (server/h2conn.py refuses it at each connection)
        if not 65535 <= self.stream_window <= (1 << 31) - 1:
            raise ValueError(f"stream_window {self.stream_window} outside 65535..2^31-1")


@lru_cache(maxsize=256)  # Envoy's ext_authz sends one value for every call (its filter's timeout)
def parse_timeout(value: bytes) -> float:
    """A ``grpc-timeout`` header (1-8 digits and a unit) in seconds; ValueError if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _TIMEOUT_UNITS:
        raise ValueError(f"malformed grpc-timeout {value!r}")
    return int(digits) * _TIMEOUT_UNITS[unit]


class _Budget:
    """A token bucket on the loop's clock: ``take()`` is False once the peer overdraws it."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, 2 * rate, 2 * rate, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - 1
        self.at = now
        return self.tokens >= 0

    def give(self, n: float) -> None:
        self.tokens = min(self.burst, self.tokens + n)


#: no-progress frames each call started earns its connection (within the burst): a client's
#: own WINDOW_UPDATEs and BDP PINGs come with its calls (grpcio's sends a 5-byte and a
#: message-sized stream WINDOW_UPDATE per unary call: at 100/s alone, its 70th sequential
#: Check was cut off as a flood)
_CONTROL_PER_CALL = 4


#: a server stream's bytes queued for the peer's windows or socket before a write waits
_STREAM_QUEUE = 64 << 10


#: frames that are call progress whatever they carry; every other frame draws from the control
#: budget (PING, SETTINGS, PRIORITY, GOAWAY, unknown types), except DATA and WINDOW_UPDATE that
#: carry something (:meth:`_Connection.inspect`)
_CALL_FRAMES = frozenset((HEADERS, CONTINUATION, RST_STREAM))


class _Abort(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _code(code: Any) -> int:
    return int(code.value[0]) if isinstance(code, grpc.StatusCode) else int(code)


class Call:
    """One RPC, and the part of ``grpc.aio.ServicerContext`` the servicers use; for a
    client- or bidirectional-streaming method also the request iterator."""

    __slots__ = (
        "_callbacks",
        "_waiter",
        "arrived",
        "buf",
        "cancelled_",
        "conn",
        "deadline",
        "ended",
        "expired",
        "first",
        "handler",
        "head_sent",
        "headers",
        "held",
        "late",
        "length",
        "messages",
        "out",
        "owed",
        "queued",
        "stopped",
        "stream_id",
        "task",
        "timer",
        "trailers",
        "writer",
    )

    def __init__(self, conn: _Connection, stream_id: int, handler: Any, headers: list[tuple[bytes, bytes]],
                 arrived: float, deadline: float | None) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.handler = handler
        self.headers = headers
        self.arrived = arrived
        self.deadline = deadline
        self.buf = bytearray()  # a request message being received
        self.held = 0  # request bytes this call holds unconsumed (flow-controlled length)
        self.owed = 0  # bytes received whose window was not reopened yet
        self.first: bytes | None = None  # a unary call's message
        self.messages: deque[bytes] = deque()  # a client stream's messages not yet read
        self.queued = 0
        self.ended = False  # the client half-closed (or the server ended its request stream: stopped)
        self.stopped = False  # a graceful stop ended the request stream the client kept open
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # the deadline's
        self.out = bytearray()  # answer bytes waiting for the peer's window
        self.head_sent = False
        self.trailers: list[tuple[bytes, bytes]] | None = None  # due once ``out`` is sent
        self.cancelled_ = False
        self.expired = False
        self.late = False  # its deadline neared while it waited for a max_active_calls slot
        self.length = -1  # DATA bytes its content-length still announces (RFC 9113 8.1.1), -1: none
        self._callbacks: list[Callable[[Call], None]] = []
        self._waiter: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None

    # -- grpc.aio.ServicerContext
    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return 0.0 if self.late else max(0.0, self.deadline - self.conn.loop.time())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.headers
                     if not k.startswith(b":"))

    def add_done_callback(self, callback: Callable[[Call], None]) -> None:
        self._callbacks.append(callback)

    def cancelled(self) -> bool:
        return self.cancelled_

    def peer(self) -> str:
        addr = self.conn.transport.get_extra_info("peername") if self.conn.transport else None
        return f"ipv4:{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "unknown"

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise _Abort(_code(code), details)

    async def write(self, message: Any) -> None:
        """Send one message of a server stream; returns once the peer's windows took it."""
        await self.conn.send(self, self.handler.response_serializer(message))

    # -- the request stream (client-streaming methods)
    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        while not self.messages:
            if self.ended or self.cancelled_:
                raise StopAsyncIteration
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self.messages.popleft()
        self.queued -= len(message) + 5
        self.conn.consumed(self, len(message) + 5)
        return self.handler.request_deserializer(message)

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def done(self) -> None:
        if self.timer is not None:  # a long grpc-timeout must not keep the call alive
            self.timer.cancel()
            self.timer = None
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("gRPC call done callback failed")


class Slots:
    """At most ``n`` holders at once, the others served in arrival order: what
    ``asyncio.Semaphore`` does, with a plain method for the common case, a slot free at once
    (:meth:`take`: no coroutine, no ``locked()`` walk of the waiters, once per unary call)."""

    __slots__ = ("_waiters", "free")

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """A slot if one is free and nobody waits for one."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self) -> bool:
        """A slot, waiting for it in turn (True; cancelled while waiting: none is held)."""
        if self.take():
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed one as it was cancelled: to the next
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        return True

    def release(self) -> None:
        """A slot given back: to the first waiter, else free."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


def call_time_left(call: Any) -> tuple[float | None, float, bool]:
    """What a gRPC door tells the check flow of a call's time (``Door.time_left``), on either
    server: Envoy's ``grpc-timeout`` as the time left (LoopLag takes the margin off it), and
    whether the deadline was stamped on arrival. grpc.aio's own threads stamp it when the call
    arrives, before (and while) the event loop runs anything else; this server stamps it when
    the loop reads the call, after any stall of the loop."""
    return call.time_remaining(), 0.0, not isinstance(call, Call)


#: accept() errors that mean the process or the system is out of something: accepting pauses
#: for a second (as asyncio's own server does) instead of spinning on a readable socket
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKLOG = 1024


def listen_sockets(host: str | None, port: int, *, reuse_port: bool = False,
                   backlog: int = _BACKLOG) -> list[socket.socket]:
    """Non-blocking listening sockets on ``host:port`` bound as ``loop.create_server`` binds
    them: every address the host resolves to (every interface when None), IPv6 ones v6-only,
    SO_REUSEADDR, and SO_REUSEPORT when asked. An address whose family this kernel lacks (no
    socket of it: ``localhost``'s ``::1`` without IPv6) or has not enabled (its bind
    EADDRNOTAVAIL) is skipped, as ``create_server`` skips it (Python 3.13's the latter too),
    with a warning; none left is an error naming them all. Any other error fails the whole."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    skipped: list[tuple[Any, OSError]] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # EAFNOSUPPORT, ...
                skipped.append((address, exc))
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()
                skipped.append((address, exc))
                continue
            sock.listen(backlog)
            sock.setblocking(False)
        if not sockets:
            errs = "; ".join(f"{address[0]}: {err.strerror or err}" for address, err in skipped)
            raise OSError(skipped[-1][1].errno if skipped else None,
                          f"no address of {host or '*'} could listen ({errs or 'none resolved'})")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    for address, err in skipped:
        log.warning("gRPC port: not listening on %s (%s): the others are", address[0], err.strerror or err,
                    extra={"fields": {"event": "grpc_listen_skipped", "address": str(address[0]),
                                      "errno": err.errno}})
    return sockets


class _TlsListener:
    """The TLS port's own accept loop. asyncio's ``ssl=`` server builds the protocol at the
    accept but calls its ``connection_made`` only after the handshake, and never calls a
    failed handshake back, so a connection could count against ``max_connections`` only once
    its handshake was done: a flood of handshakes that never finish was bounded by the
    handshake timeout alone. Here a connection counts from its accept
    (:meth:`GrpcH2Server._accepted`), one past the bound is closed at once, and the handshake
    runs in ``loop.connect_accepted_socket`` (asyncio's and uvloop's, with the same SSL
    protocol as their servers; starting TLS by hand with ``loop.start_tls`` broke Envoy's mTLS
    under uvloop), whose end, done or failed, releases the count."""

    def __init__(self, server: GrpcH2Server, sockets: list[socket.socket]) -> None:
        self.server = server
        self.sockets = sockets
        self.loop = asyncio.get_running_loop()
        self.closed = False
        for sock in sockets:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(_BACKLOG):  # what is waiting, in one go (bounded)
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_EXHAUSTED:
                    log.warning("gRPC port: cannot accept (%s): pausing accepts for 1 s", exc.strerror or exc,
                                extra={"fields": {"event": "grpc_accept_paused", "errno": exc.errno}})
                    self.loop.remove_reader(sock.fileno())
                    self.loop.call_later(1.0, self._resume, sock)
                    return
                continue  # the peer left before its accept (ECONNABORTED, ...)
            self.server._accepted(conn)

    def _resume(self, sock: socket.socket) -> None:
        if not self.closed:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in self.sockets:
            self.loop.remove_reader(sock.fileno())
            sock.close()


class GrpcH2Server:
    """gRPC over HTTP/2 on the event loop; the subset of ``grpc.aio.Server`` that
    ``add_*Servicer_to_server``, :class:`~extauthz.server.app.Server` and the tests use."""

    def __init__(self, limits: H2Limits | None = None, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.limits = limits or H2Limits()
        self.ssl_context = ssl_context
        self.handlers: dict[bytes, Any] = {}
        self.connections: set[_Connection] = set()
        self.server: asyncio.AbstractServer | _TlsListener | None = None
        #: TLS connections accepted whose handshake runs: they count against max_connections
        self.handshakes: set[asyncio.Task[None]] = set()
        self._handshake_errors = LogThrottle(log)
        self.port = 0
        self.stopping = False
        #: connections and streams refused or closed by a bound, by reason
        self.rejected: dict[str, int] = {}
        #: GOAWAY frames sent, by error code name
        self.goaways: dict[str, int] = {}
        self.calls = 0
        #: unary handlers running at once (H2Limits.max_active_calls)
        self.active = Slots(self.limits.max_active_calls)
        self._sweeper: asyncio.Task[None] | None = None
        self._terminated: asyncio.Event | None = None
        self._emptied: asyncio.Event | None = None  # set when stopping and the last connection is gone
        #: streams answered by a graceful stop whose client has not closed its side yet, and
        #: the event set when there are none (stop waits for it before closing connections)
        self.half_open = 0
        self._peers_closed: asyncio.Event | None = None

    # -- registration (what the generated add_*Servicer_to_server call)
    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        """The generated code registers each service twice; the registered handlers suffice."""

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        for method, handler in handlers.items():
            self.handlers[f"/{service}/{method}".encode()] = handler

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def goaway_sent(self, code: int) -> None:
        name = CODE_NAMES.get(code, str(code))
        self.goaways[name] = self.goaways.get(name, 0) + 1

    async def start(self, listen: str, *, reuse_port: bool = False, flag: str = "") -> int:
        """Serve on ``listen``; the port bound. A taken port raises an OSError naming ``flag``."""
        host, port = parse_listen(listen)
        loop = asyncio.get_running_loop()
        self._terminated = asyncio.Event()
        try:
            if self.ssl_context is None:
                self.server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                                       reuse_port=reuse_port or None, backlog=_BACKLOG)
            else:  # handshakes counted from the accept (_TlsListener)
                self.server = _TlsListener(self, listen_sockets(host or None, port, reuse_port=reuse_port))
        except OSError as exc:
            where = f"{listen} ({flag})" if flag else listen
            raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror or exc}") from None
        self.port = int(self.server.sockets[0].getsockname()[1])
        self._sweeper = asyncio.create_task(self._sweep(), name="extauthz-grpc-sweeper")
        return self.port

    def _accepted(self, sock: socket.socket) -> None:
        """A TLS connection accepted: counted from now (its handshake included), or closed at
        once past the bound or while stopping."""
        if self.stopping or len(self.connections) + len(self.handshakes) >= self.limits.max_connections:
            self.reject("stopping" if self.stopping else "too_many_connections")
            sock.close()
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is gone already
            sock.close()
            return
        task = asyncio.get_running_loop().create_task(self._handshake(sock), name="extauthz-grpc-handshake")
        self.handshakes.add(task)
        task.add_done_callback(self.handshakes.discard)

    async def _handshake(self, sock: socket.socket) -> None:
        """The TLS handshake of one accepted connection; once done, the connection is the
        protocol's (``connection_made``: ALPN, then counted in ``connections``). A handshake
        that fails or outlasts ``handshake_timeout`` is counted and its socket closed; so is one
        ended by anything else (a bug: logged, throttled), which never leaves the task.

        The count moves from ``handshakes`` to ``connections`` in ``connection_made`` itself
        (``_Connection.made``), not when this task ends a loop turn or two later: counted in
        both meanwhile, a connection took two places, and an accept at the bound then was
        refused. Its task ends on its own (a stop neither waits for it nor cancels it)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        task = asyncio.current_task()

        def protocol() -> _Connection:
            conn = _Connection(self)
            if task is not None:
                conn.made = partial(self.handshakes.discard, task)
            return conn

        try:
            await loop.connect_accepted_socket(protocol, sock, ssl=self.ssl_context,
                                               ssl_handshake_timeout=self.limits.handshake_timeout)
        except asyncio.CancelledError:  # a stop: the transport closed the socket
            sock.close()
            raise
        except OSError:  # ssl.SSLError, a reset, the timeout's ConnectionAbortedError: counted, closed
            timed_out = loop.time() - began >= self.limits.handshake_timeout
            self.reject("handshake_timeout" if timed_out else "tls_handshake")
            sock.close()
        except Exception:  # the server's own error (connection_made raising comes out of the
            # handshake's waiter on both loops): counted, logged, closed
            self.reject("handshake_error")
            self._handshake_errors.log(logging.ERROR, "gRPC port: a TLS connection failed in the server "
                                       "during or just after its handshake", exc_info=True,
                                       fields={"event": "grpc_handshake_error"})
            sock.close()

    async def _sweep(self) -> None:
        """Handshake, idle and request timeouts, checked a few times per smallest timeout."""
        limits = self.limits
        tick = min(1.0, limits.handshake_timeout / 4, limits.request_timeout / 4, limits.idle_timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for conn in list(self.connections):
                conn.expire(now)

    async def stop(self, grace: float | None = 5.0) -> None:
        """GOAWAY; running unary calls finish (up to ``grace`` s); request streams (the access
        log, the quota stream) are then ended and answered; what still runs is cancelled;
        connections close."""
        if self.server is None:
            return
        self.stopping = True
        self.server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        handshakes = list(self.handshakes)  # TLS handshakes still running: ended
        for task in handshakes:
            task.cancel()
        if handshakes:
            await asyncio.wait(handshakes)
        loop = asyncio.get_running_loop()
        end = loop.time() + (grace or 0.0)
        for conn in list(self.connections):
            conn.goaway()

        def running(kind: str | None) -> list[asyncio.Task[None]]:
            return [c.task for conn in self.connections for c in conn.calls.values()
                    if c.task is not None and not c.task.done()
                    and (kind is None or c.task.get_name() == kind)]

        unary = running("unary")
        if unary:
            await asyncio.wait(unary, timeout=max(0.0, end - loop.time()))
        for conn in list(self.connections):  # the access log streams: ended, answered
            for call in conn.calls.values():
                if call.handler is not None and call.handler.request_streaming and not call.ended:
                    call.ended = call.stopped = True
                    call.wake()
        streams = running("stream")
        if streams:
            await asyncio.wait(streams, timeout=max(0.1, end - loop.time()))
        for task in running(None):  # what is left (health Watch streams): cancelled
            task.cancel()
        await asyncio.sleep(0)
        # A stream answered while its client still had its side open is closed by the client
        # (grpcio: RST_STREAM NO_ERROR once it has the trailers; Envoy: a reset or END_STREAM).
        # The connection is closed after that, within close_linger: a FIN that reaches grpcio's
        # client before it closed the stream fails the call UNAVAILABLE "Stream removed",
        # whatever the trailers said (and our own RST_STREAM NO_ERROR after the trailers did
        # so every time). One close_linger bounds that wait and the close together: a client
        # that neither closes its stream nor its connection held the stop for twice as long.
        linger_end = loop.time() + self.limits.close_linger
        if self.half_open:
            self._peers_closed = asyncio.Event()
            try:
                await asyncio.wait_for(self._peers_closed.wait(), self.limits.close_linger)
            except TimeoutError:
                pass
        for conn in list(self.connections):
            conn.close()
        # the peers take what is queued and close; what is left at the linger's end is aborted
        # (nothing is left open past the loop)
        self._emptied = asyncio.Event()
        if self.connections:
            try:
                await asyncio.wait_for(self._emptied.wait(), max(0.0, linger_end - loop.time()))
            except TimeoutError:
                for conn in list(self.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
                await asyncio.sleep(0)
        self.server = None
        if self._terminated is not None:
            self._terminated.set()

    async def wait_for_termination(self) -> None:
        if self._terminated is not None:
            await self._terminated.wait()

    def peer_closed(self, n: int) -> None:
        """``n`` streams left half open by a graceful stop were closed by their client (or
        dropped with their connection)."""
        self.half_open -= n
        if not self.half_open and self._peers_closed is not None:
            self._peers_closed.set()

    def status(self) -> dict[str, Any]:
        return {"server": "asyncio", "connections": len(self.connections), "handshakes": len(self.handshakes),
                "calls": self.calls,
                "running": sum(len(c.calls) for c in self.connections), "rejected": dict(self.rejected),
                "goaways": dict(self.goaways)}

    def metrics(self) -> Iterator[Metric]:
        """The port's bounds at work, as Prometheus families (docs/operations.md)."""
        yield GaugeMetricFamily("extauthz_grpc_connections", "Connections open on the gRPC port, TLS ones "
                                "from their accept, handshake included (they count against its connection "
                                "bound).", value=len(self.connections) + len(self.handshakes))
        yield CounterMetricFamily("extauthz_grpc_calls", "gRPC calls started on the gRPC port.", value=self.calls)
        for name, help, reasons in (
                ("extauthz_grpc_connections_refused", "gRPC port connections closed before serving a "
                 "call, by reason (the connection bound, stopping, no ALPN h2, a failed or timed-out "
                 "TLS handshake or preface).", CONNECTION_REFUSED),
                ("extauthz_grpc_connections_closed", "gRPC port connections ended by a bound or a "
                 "protocol error, by reason (floods, rapid reset, slow frames, a peer not reading, "
                 "idle).", CONNECTION_CLOSED),
                ("extauthz_grpc_streams_reset", "gRPC port streams reset, by reason: refused (the "
                 "stream bound, after GOAWAY), malformed, too large, unfinished in time; "
                 "reset_by_peer: the client cancelled before the answer.", STREAM_RESET)):
            family = CounterMetricFamily(name, help, labels=["reason"])
            for reason in reasons:
                family.add_metric([reason], self.rejected.get(reason, 0))
            yield family
        yield CounterMetricFamily("extauthz_grpc_calls_late", "Unary gRPC calls (Check) whose deadline neared "
                                  "before one of the max_active_calls slots was free: run without one, told no "
                                  "time is left (the Check flow decides them without the store, counted as "
                                  "overload).", value=self.rejected.get(CALL_LATE[0], 0))
        goaways = CounterMetricFamily("extauthz_grpc_goaways_sent", "GOAWAY frames the gRPC port sent, by "
                                      "error code (NO_ERROR: a graceful stop or idle close).", labels=["code"])
        for code, n in (dict.fromkeys(GOAWAY_CODES, 0) | self.goaways).items():
            goaways.add_metric([code], n)
        yield goaways


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: its frames and stream states (:class:`H2Conn`), the calls on
    it, its bounds."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        self.limits = limits = server.limits
        self.loop = asyncio.get_running_loop()
        now = self.loop.time()
        #: when the last call ended (the idle timeout runs from it, not from any bytes: PINGs
        #: and trickled frames do not keep a connection open), and when the frame or header
        #: block now being received began
        self.opened = self.last_active = self.now = now
        self.partial_since: float | None = None
        self.unparsed = 0  # bytes read not parsed into a frame yet, after the last read
        self.in_block = False  # a header block (HEADERS, CONTINUATIONs) was unfinished after it
        self.transport: asyncio.Transport | None = None
        # The advertised stream bound is enforced on the running calls (:meth:`request`:
        # REFUSED_STREAM, a stream error); H2Conn's own, a connection error, is kept for a peer
        # that ignores it grossly. A read may open many streams before any is refused: the
        # slack is for those. A header block's encoded bytes are bounded by the header list
        # bound before any decoding (an honest block under the list bound fits: its encoded
        # form is never larger than the list by more than a few bytes per field).
        self.h2 = H2Conn(self, max_concurrent_streams=limits.max_concurrent_streams,
                         max_frame_size=limits.max_frame_size, max_header_list_size=limits.max_header_list_size,
                         header_table_size=limits.header_table_size, stream_window=limits.stream_window,
                         connection_window=limits.connection_window, max_block=limits.max_header_list_size,
                         stream_slack=256)
        self.calls: dict[int, Call] = {}
        self.buffered = 0
        self.owing: set[Call] = set()
        self.handshaken = False
        self.closed = False
        self.paused = False
        self.goaway_at: int | None = None  # last stream id of our GOAWAY
        #: streams a graceful stop answered whose client has not closed its side yet
        self.half_open: set[int] = set()
        self.peer_away = False  # the peer sent GOAWAY
        self.resets = _Budget(limits.resets_per_second, now)
        self.control = _Budget(limits.control_per_second, now)
        self._flush_soon = False

    #: a TLS connection's release of its place in ``server.handshakes``, called (once) as it
    #: is made (GrpcH2Server._handshake)
    made: Callable[[], None] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        made, self.made = self.made, None
        if made is not None:
            made()
        tls = transport.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() != "h2":  # as grpcio: ALPN h2 or nothing
            server.reject("alpn")
            self.closed = True
            transport.close()
            return
        if len(server.connections) >= self.limits.max_connections or server.stopping:
            server.reject("too_many_connections" if not server.stopping else "stopping")
            self.closed = True
            transport.close()
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=min(256 << 10, self.limits.max_write_buffer))  # type: ignore[attr-defined]
        transport.write(self.h2.data_to_send())  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.h2.halted = True
        self._forget_half_open()
        server = self.server
        server.connections.discard(self)
        if not server.connections and server._emptied is not None:
            server._emptied.set()
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for call in list(self.calls.values()):
            if call.out or call.trailers is not None:
                self._send_out(call)
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        h2 = self.h2
        self.now = now = self.loop.time()
        try:
            h2.receive(data)
        except H2Error as exc:
            self._h2_error(exc)
            return
        if self.closed:
            return
        # a frame or header block begun and not finished: due within request_timeout (expire),
        # from its own start: a read that completed a frame (fewer bytes left unparsed than
        # were there plus this read's) began the frame now pending, unless a header block
        # runs on from before (a busy connection's reads end inside frames all along)
        unparsed, self.unparsed = self.unparsed, h2.unparsed
        pending = self.unparsed
        block = h2.block_sid != 0
        if pending or block:
            if self.partial_since is None or (pending < unparsed + len(data)
                                              and not (block and self.in_block)):
                self.partial_since = now
        else:
            self.partial_since = None
        self.in_block = block
        self.flush()

    # -- what H2Conn read (its Owner)
    def inspect(self, kind: int, sid: int, flags: int, arg: int) -> None:
        """A frame that makes no call progress draws from the control budget (H2Limits
        ``control_per_second``); a flood of them ends the connection (GOAWAY
        ENHANCE_YOUR_CALM)."""
        if kind == DATA:
            if (arg or flags & 1) and sid in self.calls:  # data or END_STREAM on a call
                return
        elif kind == WINDOW_UPDATE:
            # free only when the window it widens is what holds an answer back: narrower than
            # a frame (each free one widens it by 1 KiB or more, so at most 16 in a row)
            if arg >= 1024 and self._window_holds(sid):
                return
        elif kind in _CALL_FRAMES:
            return
        if not self.control.take(self.loop.time()):
            name = {PING: "PING", SETTINGS: "SETTINGS", PRIORITY: "PRIORITY", GOAWAY: "GOAWAY", DATA: "DATA",
                    WINDOW_UPDATE: "WINDOW_UPDATE"}.get(kind, f"frame type {kind}")
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"a flood of {name} frames", "control_flood")

    def request(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        """A request's headers. A malformed request (:func:`malformed`: no ``:path``, an empty
        or uppercase name, ...) is a stream error, RST_STREAM PROTOCOL_ERROR (RFC 9113 8.1.1),
        not a connection error: one bad request must not end the others on Envoy's connection.
        Checked as each header block is read, so that a read of many bad requests never holds
        them open at once (the block was decoded: the HPACK context stays in step)."""
        if malformed(headers) is not None:
            self._malformed(sid)
            return
        self._request(sid, headers, self.now)

    def _malformed(self, sid: int) -> None:
        """A malformed request: RST_STREAM PROTOCOL_ERROR, from the control budget."""
        self.server.reject("malformed_request")
        if not self.control.take(self.loop.time()):
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, "a flood of malformed requests", "control_flood")
        self.h2.reset_stream(sid, ErrorCode.PROTOCOL_ERROR)

    def trailers(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Request trailers: nothing reads them (no gRPC client sends any); malformed ones end
        the connection, as h2's validation did (a stream error may be, RFC 9113 5.4.1)."""
        why = malformed(headers, trailers=True)
        if why is not None:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"malformed request trailers: {why}")

    def data(self, sid: int, data: bytes, n: int, end: bool) -> None:
        self._data(sid, data, n)

    def ended(self, sid: int) -> None:
        self._ended(sid)

    def reset(self, sid: int, by_peer: bool) -> None:
        if by_peer:
            self._reset(sid, self.now)
            return
        # a stream error of ours the peer provoked (DATA after END_STREAM, a WINDOW_UPDATE of 0 or
        # past 2^31-1): it cancels the handler and frees the stream's place as the peer's own
        # RST_STREAM does, so it draws from the same budget (MadeYouReset, CVE-2025-8671)
        call = self.calls.pop(sid, None)
        if call is not None:
            self._provoked(call)
            self._cancel(call)

    def _provoked(self, call: Call) -> None:
        """This server ends ``call`` before its answer for what the peer sent (a stream error,
        a request stream's message too large or compressed): that cancels its handler and frees
        its place among the concurrent streams as the peer's own RST_STREAM does, so it draws
        from the same budget (rapid reset by the server's RST_STREAM: MadeYouReset,
        CVE-2025-8671)."""
        if call.trailers is None and not self.resets.take(self.now):
            self._calm("rapid_reset")

    def window(self, sid: int) -> None:
        self._window(sid)

    def spoke(self) -> None:
        self.handshaken = True

    def peer_goaway(self) -> None:
        """The peer's GOAWAY: the calls it still waits on finish, then the connection is
        closed (Envoy sends GOAWAY when it drains a connection). A stream the peer opens after
        its own GOAWAY (it should open none) is still served; only streams above *our*
        GOAWAY's last id are refused (:meth:`_request`)."""
        self.peer_away = True
        if not self.calls:
            self.flush()
            self.close()

    def _window_holds(self, sid: int) -> bool:
        """An answer waits, and the connection's window (``sid`` 0) or stream ``sid``'s is
        narrower than a frame (a wider one is not what holds the answer back)."""
        h2 = self.h2
        if sid == 0:
            return (h2.outbound_flow_control_window < h2.max_outbound_frame_size
                    and any(c.out for c in self.calls.values()))
        call = self.calls.get(sid)
        stream = h2.streams.get(sid)
        return (call is not None and bool(call.out) and stream is not None
                and stream.send_window < h2.max_outbound_frame_size)

    def _request(self, sid: int, headers: list[tuple[bytes, bytes]], now: float) -> None:
        server = self.server
        if self.goaway_at is not None and sid > self.goaway_at:
            self._refuse(sid, "after_goaway")
            return
        if len(self.calls) >= self.limits.max_concurrent_streams:
            self._refuse(sid, "too_many_streams")
            return
        fields = dict(headers)  # (a field given twice: the last, as a loop over them would take)
        get = fields.get
        path, method, ctype = get(b":path", b""), get(b":method", b""), get(b"content-type", b"")
        timeout, encoding = get(b"grpc-timeout", b""), get(b"grpc-encoding", b"")
        length: bytes | None = get(b"content-length")
        # gRPC clients send none; if sent, it must be one length, and hold (RFC 9113 8.1.1)
        if length is not None and (not length.isdigit() or len(length) > 18
                                   or sum(k == b"content-length" for k, _ in headers) > 1):
            self._malformed(sid)
            return
        if method != b"POST":
            self._http_error(sid, b"405")
            return
        if not ctype.startswith(b"application/grpc"):
            self._http_error(sid, b"415")
            return
        handler = server.handlers.get(path)
        if handler is None:
            self._trailers_only(sid, UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}")
            return
        if encoding and encoding != b"identity":
            self._trailers_only(sid, UNIMPLEMENTED, f"message compression {encoding.decode('latin-1')} "
                                "is not supported", [(b"grpc-accept-encoding", b"identity")])
            return
        deadline = None
        if timeout:
            try:
                deadline = now + parse_timeout(timeout)
            except ValueError as exc:
                self._trailers_only(sid, INTERNAL, str(exc))
                return
        call = Call(self, sid, handler, headers, now, deadline)
        if length is not None:
            call.length = int(length)
        self.calls[sid] = call
        server.calls += 1
        self.control.give(_CONTROL_PER_CALL)
        if deadline is not None:
            call.timer = self.loop.call_at(deadline, self._expire, call)
        if handler.request_streaming:
            self._start(call)

    def _data(self, sid: int, data: bytes, n: int) -> None:
        call = self.calls.get(sid)
        if call is None or call.trailers is not None or (call.task is not None and not call.handler.request_streaming):
            if n:  # nobody reads it (answered, or a call that has its message): dropped
                self.h2.acknowledge_received_data(n, sid)
            return
        if call.length >= 0:
            call.length -= len(data)
            if call.length < 0:
                self.h2.acknowledge_received_data(n, sid)
                self._wrong_length(call)
                return
        buf = call.buf
        buf += data
        call.held += n
        self.buffered += n
        limit = self.limits.max_message_bytes
        streaming = call.handler.request_streaming
        while len(buf) >= 5:
            flag = buf[0]
            length = int.from_bytes(buf[1:5], "big")
            if length > limit:
                self.server.reject("message_too_large")
                self.h2.acknowledge_received_data(n, sid)  # dropped: the window is credited
                self._provoked(call)
                self._finish(call, RESOURCE_EXHAUSTED,
                             f"request message larger than {limit} bytes ({length})")
                return
            if flag != 0:
                self.h2.acknowledge_received_data(n, sid)
                self._provoked(call)
                self._finish(call, INTERNAL,
                             "compressed request message, but no compression was negotiated"
                             if flag == 1 else f"bad message flag {flag}")
                return
            if len(buf) < 5 + length:
                break
            message = bytes(buf[5:5 + length])
            del buf[:5 + length]
            if streaming:
                call.messages.append(message)
                call.queued += 5 + length
                call.wake()
            elif call.first is None:
                call.first = message
            else:
                self.h2.acknowledge_received_data(n, sid)
                self._finish(call, UNIMPLEMENTED, "more than one request message for a unary method")
                return
        if self.buffered <= self.limits.max_buffered and (not streaming or call.queued <= self.limits.stream_window):
            self.h2.acknowledge_received_data(n, sid)
        else:
            call.owed += n
            self.owing.add(call)

    def consumed(self, call: Call, n: int) -> None:
        """``n`` request bytes of ``call`` were read by its handler: windows may reopen."""
        n = min(n, call.held)
        call.held -= n
        self.buffered -= n
        if self.owing and self.buffered <= self.limits.max_buffered:
            for owed in list(self.owing):
                if owed.handler.request_streaming and owed.queued > self.limits.stream_window:
                    continue
                self._settle(owed)
            self._flush_later()

    def _settle(self, call: Call) -> None:
        """The connection window is credited for what ``call`` still owes (also for a call
        answered or gone: the connection's only)."""
        self.owing.discard(call)
        if call.owed and not self.closed:
            self.h2.acknowledge_received_data(call.owed, call.stream_id)
        call.owed = 0

    def _ended(self, sid: int) -> None:
        call = self.calls.get(sid)
        if call is None:
            self._peer_closed(sid)
            return
        call.ended = True
        if call.length > 0 and call.trailers is None:
            self._wrong_length(call)
            return
        if call.handler.request_streaming:
            if call.buf:
                self._finish(call, INTERNAL, "the request stream ended inside a message")
            else:
                call.wake()
            return
        if call.task is not None or call.trailers is not None:
            return
        if call.first is None or call.buf:
            self._finish(call, INTERNAL, "the request ended without one whole message")
            return
        self._start(call)

    def _wrong_length(self, call: Call) -> None:
        """The request's DATA did not add up to its content-length: malformed (RFC 9113
        8.1.1), RST_STREAM PROTOCOL_ERROR; a running handler cancelled (the reset budget)."""
        sid = call.stream_id
        del self.calls[sid]
        self.server.reject("malformed_request")
        self._provoked(call)
        self._cancel(call)
        self.h2.reset_stream(sid, ErrorCode.PROTOCOL_ERROR)

    def _start(self, call: Call) -> None:
        h = call.handler
        if h.response_streaming:
            coro = self._server_stream(call)
        elif h.request_streaming:
            coro = self._stream_unary(call)
        else:
            coro = self._unary_unary(call)
        call.task = self.loop.create_task(
            coro, name="stream" if h.request_streaming else "watch" if h.response_streaming else "unary")

    def _window(self, sid: int) -> None:
        if sid:
            call = self.calls.get(sid)
            if call is not None and (call.out or call.trailers is not None):
                self._send_out(call)
            return
        for call in list(self.calls.values()):
            if call.out or call.trailers is not None:
                self._send_out(call)

    def _reset(self, sid: int, now: float) -> None:
        call = self.calls.pop(sid, None)
        if call is None:
            self._peer_closed(sid)
            return
        if call.trailers is None:  # reset before its answer
            self.server.reject("reset_by_peer")
            if not self.resets.take(now):
                self._calm("rapid_reset")
        self._cancel(call)

    # -- the calls
    async def _unary_unary(self, call: Call) -> None:
        h = call.handler
        code, details, body = OK, "", None
        try:
            request = h.request_deserializer(call.first)
            call.first = None
            self.consumed(call, call.held)
            slots = self.server.active
            # no slot by its deadline: run now, told no time is left (no store call)
            held = slots.take() or await (slots.acquire() if call.deadline is None else self._slot(call, slots))
            try:
                body = h.response_serializer(await h.unary_unary(request, call))
            finally:
                if held:
                    slots.release()
        except _Abort as a:
            code, details = a.code, a.details
        except asyncio.CancelledError:
            if not call.expired:
                return
            code, details = DEADLINE_EXCEEDED, "deadline exceeded"
        except Exception as exc:
            code, details = self._failed(call, exc)
        if body is not None:
            self._queue(call, body)
        self._finish(call, code, details)

    async def _slot(self, call: Call, active: Slots) -> bool:
        """Wait for one of the ``max_active_calls`` slots until the call's deadline less
        Envoy's margin; False when that passed first (the call is then marked ``late``: its
        ``time_remaining()`` is 0, and the Check flow decides it without the store, counted as
        ``overload``, instead of Envoy timing it out unseen)."""
        assert call.deadline is not None
        try:
            async with asyncio.timeout_at(call.deadline - margin(call.deadline - call.arrived)):
                await active.acquire()
        except TimeoutError:
            call.late = True
            self.server.reject("no_slot_in_time")
            return False
        return True

    async def _server_stream(self, call: Call) -> None:
        """A server-streaming call: one request (health Watch) or a request stream (the rate
        limit quota stream, bidirectional: the call is its request iterator)."""
        h = call.handler
        code, details = OK, ""
        try:
            if h.request_streaming:
                result = h.stream_stream(call, call)
            else:
                request = h.request_deserializer(call.first)
                call.first = None
                self.consumed(call, call.held)
                result = h.unary_stream(request, call)
            if hasattr(result, "__aiter__"):
                async for message in result:
                    await call.write(message)
            else:
                await result
        except _Abort as a:
            code, details = a.code, a.details
        except asyncio.CancelledError:
            if (status := self._stream_cancelled(call)) is None:
                return
            code, details = status
        except Exception as exc:
            code, details = self._failed(call, exc)
        self._finish(call, code, details)

    @staticmethod
    def _stream_cancelled(call: Call) -> tuple[int, str] | None:
        """A streaming call's task cancelled: no answer when the peer reset it, else the status
        (its grpc-timeout passed, or the server is stopping)."""
        if call.cancelled_ and not call.expired:
            return None
        return (DEADLINE_EXCEEDED, "deadline exceeded") if call.expired else (UNAVAILABLE, "the server is stopping")

    async def _stream_unary(self, call: Call) -> None:
        h = call.handler
        code, details, body = OK, "", None
        try:
            body = h.response_serializer(await h.stream_unary(call, call))
        except _Abort as a:
            code, details = a.code, a.details
        except asyncio.CancelledError:
            if (status := self._stream_cancelled(call)) is None:
                return
            code, details = status
        except Exception as exc:
            code, details = self._failed(call, exc)
        if body is not None:
            self._queue(call, body)
        self._finish(call, code, details)

    def _failed(self, call: Call, exc: Exception) -> tuple[int, str]:
        log.exception("gRPC method failed on stream %d", call.stream_id)
        return UNKNOWN, f"unexpected {type(exc).__name__}"

    def _expire(self, call: Call) -> None:
        """The call's grpc-timeout passed: DEADLINE_EXCEEDED (its handler cancelled)."""
        if call.trailers is not None or self.calls.get(call.stream_id) is not call:
            return
        call.expired = call.cancelled_ = True
        if call.task is not None and not call.task.done():
            call.task.cancel()
        else:
            self._finish(call, DEADLINE_EXCEEDED, "deadline exceeded")

    # -- answers
    async def send(self, call: Call, body: bytes) -> None:
        """One message of a server stream, waiting while more than :data:`_STREAM_QUEUE`
        bytes of the call wait for the peer's windows or socket (grpc_health's Watch writes
        holding the lock every status change takes: a write that waited on a peer that never
        reads held the graceful stop forever)."""
        if call.cancelled_ or call.trailers is not None or self.closed:
            raise asyncio.CancelledError
        self._queue(call, body)
        self._send_out(call)
        self._flush_later()
        while len(call.out) > _STREAM_QUEUE and not call.cancelled_ and not self.closed:
            call.writer = self.loop.create_future()
            try:
                await call.writer
            finally:
                call.writer = None
        if call.cancelled_ or self.closed:
            raise asyncio.CancelledError

    def _queue(self, call: Call, body: bytes) -> None:
        call.out += len(body).to_bytes(5, "big")  # flag 0, then the length
        call.out += body

    def _finish(self, call: Call, code: int, details: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer the call with its status (after its queued messages), and ``extra`` trailers."""
        if call.trailers is not None or self.closed or self.calls.get(call.stream_id) is not call:
            return
        trailers = _OK if code == OK and not details and not extra else [(b"grpc-status", str(code).encode())]
        if extra:
            trailers += extra
        if details:
            trailers.append((b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
                             .encode("ascii")))
        call.trailers = trailers
        if call.task is not None and not call.task.done() and call.task is not asyncio.current_task(self.loop):
            call.task.cancel()
        self._send_out(call)
        self._flush_later()

    def _send_out(self, call: Call) -> None:
        """Send what the call has as far as the windows allow; its trailers last."""
        if self.closed or self.paused:
            return
        h2 = self.h2
        sid = call.stream_id
        stream = h2.sendable(sid)
        if stream is None:  # the stream is gone (reset meanwhile)
            self._cancel(call)
            self.calls.pop(sid, None)
            return
        out = call.out
        if (call.trailers is _OK and not call.head_sent and out and not h2.table_update
                and len(out) <= h2.max_outbound_frame_size and len(out) <= stream.send_window
                and len(out) <= h2.outbound_flow_control_window):
            self._answer(call, h2, sid, stream, out)
            return
        if not call.head_sent:
            if not out and call.trailers is not None:  # Trailers-Only
                h2.send_headers(sid, _HEAD_BLOCK + encode_headers(call.trailers), end_stream=True)
                self._done(call)
                return
            h2.send_headers(sid, _HEAD_BLOCK)
            call.head_sent = True
        while out:
            size = min(len(out), stream.send_window, h2.outbound_flow_control_window, h2.max_outbound_frame_size)
            if size <= 0:
                break
            h2.send_data(sid, out[:size])
            del out[:size]
        if not out:
            if call.writer is not None and not call.writer.done():
                call.writer.set_result(None)
            if call.trailers is not None:
                h2.send_headers(sid, encode_headers(call.trailers), end_stream=True)
                self._done(call)

    def _answer(self, call: Call, h2: H2Conn, sid: int, stream: Stream, out: bytearray) -> None:
        """The common answer (one message that the windows take, grpc-status 0) written as
        three frames of constant header blocks in one write."""
        n = len(out)
        stream.send_window -= n
        h2.outbound_flow_control_window -= n
        head = sid.to_bytes(4, "big")
        h2.out += b"".join((
            b"\x00\x00\x14\x01\x04", head, _HEAD_BLOCK,  # HEADERS, END_HEADERS
            n.to_bytes(3, "big"), b"\x00\x00", head, out,  # DATA
            b"\x00\x00\x0f\x01\x05", head, _OK_BLOCK))  # HEADERS, END_HEADERS | END_STREAM
        out.clear()
        call.head_sent = True
        h2.local_ended(sid, stream)
        self._done(call)

    def _done(self, call: Call) -> None:
        """The call's answer is out: forget it, reset its request side if still open."""
        sid = call.stream_id
        if self.calls.get(sid) is call:
            del self.calls[sid]
        if call.held:
            self.consumed(call, call.held)
        self._settle(call)
        self.last_active = self.loop.time()
        if not call.ended:
            self.h2.reset_stream(sid, ErrorCode.NO_ERROR)
        elif call.stopped and not self.closed:  # the client closes its side (stop waits for it)
            self.half_open.add(sid)
            self.server.half_open += 1
        if call.writer is not None and not call.writer.done():
            call.writer.set_result(None)
        call.done()
        if (self.goaway_at is not None or self.peer_away) and not self.calls:  # drained: closed once written
            self.loop.call_soon(self._drained)

    def _drained(self) -> None:
        if not self.calls and not self.half_open:
            self.flush()
            self.close()

    def _peer_closed(self, sid: int) -> None:
        """The client closed a stream a graceful stop had answered (END_STREAM or RST_STREAM)."""
        if sid in self.half_open:
            self.half_open.discard(sid)
            self.server.peer_closed(1)
            if not self.half_open and not self.calls and (self.goaway_at is not None or self.peer_away):
                self.loop.call_soon(self._drained)

    def _forget_half_open(self) -> None:
        if self.half_open:
            self.server.peer_closed(len(self.half_open))
            self.half_open.clear()

    def _cancel(self, call: Call) -> None:
        """The call can no longer be answered (reset, connection lost)."""
        if call.trailers is not None and not call.out and call.head_sent:
            return  # answered already
        call.cancelled_ = True
        if call.held:
            self.consumed(call, call.held)
        self._settle(call)
        self.last_active = self.loop.time()
        call.out.clear()
        if call.task is not None and not call.task.done():
            call.task.cancel()
        call.wake()
        if call.writer is not None and not call.writer.done():
            call.writer.set_result(None)
        call.trailers = call.trailers or []
        call.done()

    def _trailers_only(self, sid: int, code: int, details: str,
                       extra: list[tuple[bytes, bytes]] | None = None) -> None:
        call = Call(self, sid, None, [], 0.0, None)
        self.calls[sid] = call
        self._finish(call, code, details, extra)

    def _http_error(self, sid: int, status: bytes) -> None:
        if self.h2.sendable(sid) is not None:
            self.h2.send_headers(sid, encode_headers([(b":status", status)]), end_stream=True)
            self.h2.reset_stream(sid, ErrorCode.NO_ERROR)

    def _refuse(self, sid: int, reason: str) -> None:
        self.server.reject(reason)
        self.h2.reset_stream(sid, ErrorCode.REFUSED_STREAM)

    # -- the connection
    def _flush_later(self) -> None:
        if not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_soon = False
        if self.transport is None or self.closed or self.transport.is_closing():
            return
        out = self.h2.out
        if out:
            self.transport.write(bytes(out))
            out.clear()
        if self.paused and self.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            self.server.reject("peer_not_reading")
            self.transport.abort()

    def _h2_error(self, exc: H2Error) -> None:
        """A connection error (what the peer sent broke the protocol or a bound): GOAWAY with
        its code (a header block that does not decode: COMPRESSION_ERROR, RFC 9113 4.3; a
        flood: ENHANCE_YOUR_CALM), counted by its reason, then closed."""
        reason = exc.reason or "protocol_error"
        self.server.reject(reason)
        if reason == "control_flood":
            log.warning("gRPC connection closed: %s", exc,
                        extra={"fields": {"event": "grpc_connection_calm", "reason": reason}})
        else:
            log.debug("gRPC connection: HTTP/2 error: %s", exc)
        self._close_with(exc.code)

    def _close_with(self, code: int) -> None:
        if self.transport is not None and not self.closed and not self.transport.is_closing():
            self.transport.write(self._goaway_frame(code))
        self.close(at_once=True)

    def _calm(self, reason: str) -> None:
        """A flood: GOAWAY ENHANCE_YOUR_CALM, then closed."""
        self.server.reject(reason)
        log.warning("gRPC connection closed: %s", reason.replace("_", " "),
                    extra={"fields": {"event": "grpc_connection_calm", "reason": reason}})
        self._close_with(ErrorCode.ENHANCE_YOUR_CALM)

    def _goaway_frame(self, code: int) -> bytes:
        self.server.goaway_sent(code)
        return self.h2.data_to_send() + self.h2.goaway_frame(code)

    def goaway(self) -> None:
        """Graceful: no stream above the last one seen is served; the rest finish."""
        if self.closed or self.transport is None or self.goaway_at is not None:
            return
        self.goaway_at = self.h2.highest_inbound_stream_id
        self.transport.write(self._goaway_frame(ErrorCode.NO_ERROR))

    def expire(self, now: float) -> None:
        if self.closed:
            return
        limits = self.limits
        if not self.handshaken:
            if now - self.opened > limits.handshake_timeout:
                self.server.reject("handshake_timeout")
                self.close()
            return
        if self.partial_since is not None and now - self.partial_since > limits.request_timeout:
            self._calm("slow_frame")
            return
        if not self.calls:
            if now - self.last_active > limits.idle_timeout:
                self.server.reject("idle_timeout")
                self.goaway()
                self.close()
            return
        for call in list(self.calls.values()):
            if (call.task is None and call.trailers is None and call.handler is not None
                    and now - call.arrived > limits.request_timeout):
                self.server.reject("request_timeout")
                self._cancel(call)
                self.calls.pop(call.stream_id, None)
                self.h2.reset_stream(call.stream_id, ErrorCode.CANCEL)
        self.flush()

    def close(self, *, at_once: bool = False) -> None:
        """Closed once what is queued is written: our side is shut (FIN after the GOAWAY)
        while what the peer still sends is read and dropped, so that its bytes in flight do
        not turn the close into a reset that loses the GOAWAY; after ``close_linger`` the
        connection is aborted whatever the peer does, at once on an error or a flood if the
        peer is not reading (writing paused: its buffer past the high-water mark). It counts
        against ``max_connections`` until its socket is gone (:meth:`connection_lost`)."""
        transport = self.transport
        if transport is not None and not self.closed and not transport.is_closing():
            self.flush()  # what is owed (trailers of calls just ended) goes out first
            if at_once and self.paused:  # an error or a flood, and the peer is not reading
                transport.abort()
            else:
                try:
                    if transport.can_write_eof():
                        transport.write_eof()
                    else:
                        transport.close()
                except OSError:  # the peer is gone already (shutdown: ENOTCONN)
                    transport.abort()
                else:
                    self.loop.call_later(self.limits.close_linger, transport.abort)
        self.closed = self.h2.halted = True
        self._forget_half_open()
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()
