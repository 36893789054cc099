"""The lean client path: one connection per Redis node, a small asyncio protocol with
hiredis parsing and a FIFO of futures.

A profile of the redis-py path showed most of the client CPU per check in redis-py's
per-call machinery (connection checkout and release, ``read_response`` one reply at a
time through a StreamReader, timeouts per read), not in Redis or in the parse itself.
Here a batch's commands are written with one ``transport.write`` and every reply is parsed
by ``hiredis.Reader`` straight from ``data_received`` into the future waiting at the head of
the FIFO: concurrent batches pipeline on the one connection without waiting for each other.

redis-py stays for everything off the hot path: the connection is opened by redis-py's own
connection class (URL options, TLS for ``rediss://``, AUTH/ACL, SELECT, Sentinel's master
discovery, Cluster node addresses), then its transport is taken over by this protocol.
A lost connection fails every waiting call (the engine fails open within its deadline), and
so does every call until a new one is open: no call waits for a reconnect. A connection that
does not answer within the socket timeout is *retired*, not dropped: no call is sent on it
any more (a new one is opened), but it keeps reading the replies of what was already written,
because those commands run when Redis resumes (:class:`.wire.Unanswered`: their outcome
arrives late, and the engine gives back what they committed). Reconnects run
in the background, one attempt at a time, started by the calls that find no connection, at
most one per :data:`RECONNECT_BACKOFF` delay after a failed attempt (after a Redis restart,
or to the new master after a Sentinel failover: Sentinel disconnects the clients of a
demoted master). Measured: with Redis killed, a connect attempt per call made a failing
check cost ~900 us of CPU instead of ~135 us (redis-py 8's connection constructor reads the
package version through importlib.metadata), which saturated the event loop at 1,000
checks/s for the ~0.6 s the breaker took to open (p99 +67 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import hiredis
from redis import exceptions as rx
from redis.asyncio.connection import AbstractConnection

from ...core.backoff import Backoff
from .wire import UNKNOWN, Unanswered

__all__ = ["RECONNECT_BACKOFF", "RETIRED_LIMIT", "RETIRED_READ_FOR", "NodeConnection", "RespProtocol"]

#: Delay before the next connect attempt after ``n`` failed ones in a row: 2.5-5 ms after
#: the first, doubling to 0.5-1 s (the first attempt after a loss starts at once).
RECONNECT_BACKOFF_CAP: Final = 1.0
RECONNECT_BACKOFF: Final = Backoff(first=0.005, cap=RECONNECT_BACKOFF_CAP)

#: Error replies after which the connection is dropped (a reconnect follows, through
#: Sentinel to the current master): the node is no longer the writable master.
_RECONNECT_ON: Final = (b"READONLY", b"MASTERDOWN", b"LOADING")

#: Seconds a retired connection (no reply within the socket timeout) keeps reading the
#: replies of the commands written on it before it is dropped: as long as the default lease
#: TTL, since a stalled check that runs later than that holds its lease that long anyway.
RETIRED_READ_FOR: Final = 60.0
#: Retired connections kept reading per node; a further retirement drops the oldest.
RETIRED_LIMIT: Final = 4


class RespProtocol(asyncio.Protocol):
    """RESP replies parsed by hiredis and handed, in order, to a FIFO of futures."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._reader = hiredis.Reader(protocolError=rx.InvalidResponse,
                                      replyError=rx.ResponseError)
        self._waiters: deque[asyncio.Future[Any]] = deque()
        #: when each waiting command was written (``time.monotonic()``: the loop's clock is
        #: the time its turn began, up to a whole busy turn earlier), in the same order
        self._sent: deque[float] = deque()
        #: called once when the connection is lost (the owner starts reconnecting)
        self.on_lost: Callable[[], None] | None = None
        #: retired (see :meth:`retire`): nothing is sent, replies are still read
        self.retired = False
        self._give_up: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            reply = reader.gets()
        except rx.InvalidResponse as exc:
            self.abort(exc)
            return
        while reply is not False:
            drop = False
            if isinstance(reply, rx.ResponseError):
                reply, drop = _error(reply)
            if self._waiters:
                future = self._waiters.popleft()
                self._sent.popleft()
                if not future.done():  # its caller may have gone: the reply is dropped
                    future.set_result(reply)
            if drop:
                self.abort(rx.ConnectionError(f"redis: {reply}"))
                return
            try:
                reply = reader.gets()
            except rx.InvalidResponse as exc:
                self.abort(exc)
                return
        if self.retired and not self._waiters:  # every late reply came: done with it
            self.abort(rx.ConnectionError("redis: retired connection closed"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or rx.ConnectionError("redis: connection closed by the server"))

    def send(self, data: bytes, count: int) -> list[asyncio.Future[Any]]:
        """Write ``data`` (``count`` commands); one future per reply, in order."""
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise rx.ConnectionError(f"redis: connection lost ({self.lost})")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]
        self._waiters.extend(futures)
        self._sent.extend(itertools.repeat(time.monotonic(), count))
        self.transport.write(data)
        return futures

    @property
    def waiting_since(self) -> float | None:
        """When the oldest command still waiting for its reply was written (monotonic)."""
        return self._sent[0] if self._sent else None

    def retire(self, exc: BaseException, read_for: float) -> None:
        """Send nothing more (the owner reconnects, as after a loss) but keep reading: the
        commands written may still run (Redis stalled, not gone), and their replies are
        what tells whether they committed. Closed once every reply came, or after
        ``read_for`` seconds (the calls still waiting then get ``exc``)."""
        if self.lost is not None:
            return
        self.retired = True
        self._note_lost(exc)
        if not self._waiters:
            self.abort(exc)
        else:
            self._give_up = asyncio.get_running_loop().call_later(read_for, self.abort, exc)

    def abort(self, exc: BaseException) -> None:
        """Drop the connection: every waiting call gets ``exc``."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _note_lost(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
            if self.on_lost is not None:
                self.on_lost()

    def _fail(self, exc: BaseException) -> None:
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        self._note_lost(exc)
        self._sent.clear()
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: its caller may have gone


def _error(reply: rx.ResponseError) -> tuple[rx.ResponseError, bool]:
    """An error reply as redis-py's class for it (NOSCRIPT drives the reload path), and
    whether the connection must be dropped."""
    message = str(reply)
    if message.startswith("NOSCRIPT"):
        return rx.NoScriptError(message), False
    return reply, message.encode()[:16].startswith(_RECONNECT_ON)


class NodeConnection:
    """One connection to one Redis node, opened on first use and again after a loss.

    ``make()`` builds an unconnected redis-py connection (``pool.make_connection()``, or a
    cluster node's connection class); its ``connect()`` does TLS, AUTH, SELECT and
    Sentinel discovery, and its socket timeout bounds how long a call waits for replies
    (the engine's deadline is the real one; this only frees a dead connection).
    """

    def __init__(self, make: Callable[[], AbstractConnection]) -> None:
        self._make = make
        self._protocol: RespProtocol | None = None
        self._opening: asyncio.Task[RespProtocol] | None = None
        #: when the connect attempt under way began (time.monotonic())
        self._opening_since = 0.0
        self._timeout: float | None = None
        self._writer: asyncio.StreamWriter | None = None
        #: connections opened, connect attempts, failed attempts in a row
        self.connects = 0
        self.attempts = 0
        #: failed attempts, and connections dropped before a good reply, in a row
        self._failures = 0
        self._next_attempt = 0.0
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        #: retired connections still reading late replies (see :meth:`_retire`)
        self._retired: list[RespProtocol] = []
        #: set while a connection is open (and once closed: waiters then find it closed)
        self._open_now = asyncio.Event()

    @property
    def waiting_since(self) -> float | None:
        """When the oldest command still waiting on the open connection was written; with no
        open connection and a connect attempt under way, when the attempt began (a call
        waiting for it waits on the store)."""
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol.waiting_since
        if self._opening is not None and not self._opening.done():
            return self._opening_since
        return None

    async def call(self, data: bytes, count: int, *, late: bool = False,
                   sent: Callable[[list[asyncio.Future[Any]]], None] | None = None) -> list[Any]:
        """Send ``count`` packed commands and return their replies (error replies in place).
        Without a connection it raises at once (after a loss) or waits for the first one.
        Commands written and not answered (socket timeout, connection lost) raise
        :class:`.wire.Unanswered` with ``late`` (their replies if they come after all), else
        ``redis.TimeoutError`` or the connection's error. ``sent`` is told, once written, the
        futures of the replies (done as soon as each reply is read)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self.connect(wait=protocol is None)
        futures = protocol.send(data, count)
        if sent is not None:
            sent(futures)
        # Replies come in order and a loss fails every one left: the last one done means
        # all are. Waited for without cancelling it: a late reply is still read.
        if futures and not futures[-1].done():
            done, _ = await asyncio.wait((futures[-1],), timeout=self._timeout)
            if not done:
                message = f"redis: no reply within {self._timeout} s"
                self._retire(protocol, rx.TimeoutError(message))
                if late:
                    raise Unanswered(message, _gathered(futures), timed_out=True)
                raise rx.TimeoutError(message)
        lost = next((error for f in futures if not f.cancelled() and (error := f.exception()) is not None),
                    None)
        if lost is not None:  # written, then the connection was lost: they may have run
            if late:
                raise Unanswered(f"redis: {lost}", _gathered(futures), timed_out=False) from lost
            raise lost
        replies = [f.result() for f in futures]
        if protocol.lost is None:
            self._failures = 0  # a good connection: the next loss reconnects at once
        return replies

    def _retire(self, protocol: RespProtocol, error: BaseException) -> None:
        """``protocol`` did not answer in time: retired (:meth:`RespProtocol.retire`), kept
        reading while a new connection serves the calls; at most :data:`RETIRED_LIMIT` per
        node (the oldest is dropped: what it still waits for stays unknown)."""
        if protocol.retired or protocol.lost is not None:
            return  # already retired (by an earlier call on it) or lost
        self._retired = [p for p in self._retired if p.transport is not None
                         and not p.transport.is_closing()]
        if len(self._retired) >= RETIRED_LIMIT:
            self._retired.pop(0).abort(rx.ConnectionError("redis: too many retired connections"))
        protocol.retire(error, RETIRED_READ_FOR)
        self._retired.append(protocol)

    async def connect(self, *, wait: bool = True) -> RespProtocol:
        """The open connection; else a connect attempt is started in the background (unless
        one is under way or the backoff delay has not passed) and, with ``wait``, awaited:
        concurrent callers share it. Without ``wait``, or while backing off, it raises."""
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._closed:
            raise rx.ConnectionError("redis: store closed")
        under_way = self._opening is not None and not self._opening.done()
        if not under_way and asyncio.get_running_loop().time() < self._next_attempt:
            raise rx.ConnectionError("redis: not connected (the next connect attempt is backing off)")
        task = self._start_attempt()
        if not wait:
            raise rx.ConnectionError("redis: connection lost (reconnecting in the background)")
        return await asyncio.shield(task)

    async def _attempt(self) -> RespProtocol:
        """One connect attempt. A failed one schedules the next after the backoff delay, and
        so on until one opens (a lost connection starts them: :meth:`_lost`): no call has to
        come, so the breaker's first probe after an outage finds the connection open. The
        backoff is reset only by a good reply, not by a connect (a node that accepts
        connections and then answers READONLY or LOADING is not reconnected to at once
        again and again)."""
        self.attempts += 1
        try:
            protocol = await self._open()
        except Exception:
            self._failures += 1
            self._schedule(RECONNECT_BACKOFF.compute(self._failures))
            raise
        return protocol

    def _start_attempt(self) -> asyncio.Task[RespProtocol]:
        """The connect attempt under way, or a new one (one at a time)."""
        task = self._opening
        if task is None or task.done():
            self._opening_since = time.monotonic()
            task = self._opening = asyncio.get_running_loop().create_task(self._attempt())
            task.add_done_callback(_retrieve)
        return task

    def _schedule(self, delay: float) -> None:
        """The next attempt in ``delay`` seconds (none once closed), replacing one planned."""
        loop = asyncio.get_running_loop()
        self._next_attempt = loop.time() + delay
        if self._retry is not None:
            self._retry.cancel()
        self._retry = None if self._closed else loop.call_later(delay, self._try_again)

    def _lost(self, protocol: RespProtocol) -> None:
        """The connection ``protocol`` was lost: reconnect in the background, at once after
        a good connection, after the backoff delay after one dropped before a good reply
        (a node answering READONLY or LOADING)."""
        if self._closed or protocol is not self._protocol:
            return
        self._open_now.clear()
        self._failures += 1
        self._schedule(0.0 if self._failures == 1 else RECONNECT_BACKOFF.compute(self._failures - 1))

    def _try_again(self) -> None:
        self._retry = None
        protocol = self._protocol
        if self._closed or (protocol is not None and protocol.lost is None):
            return
        self._start_attempt()

    async def _open(self) -> RespProtocol:
        conn = self._make()
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            await conn.disconnect()
            raise
        writer = getattr(conn, "_writer", None)
        transport: Any = writer.transport if writer is not None else None
        if transport is None or not hasattr(transport, "set_protocol"):  # uvloop's: no subclass
            await conn.disconnect()
            raise rx.ConnectionError("redis: the connection has no transport to take over")
        self._timeout = getattr(conn, "socket_timeout", None)
        # The transport is ours now: redis-py's connection lets go of it (its __del__ would
        # warn about an unclosed connection); its StreamWriter is kept until the transport
        # is replaced (a StreamWriter collected while its transport is open warns too).
        conn._writer = conn._reader = None
        self._writer = writer
        protocol = RespProtocol()
        protocol.on_lost = lambda: self._lost(protocol)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        old = self._protocol
        self._protocol = protocol
        self.connects += 1
        self._open_now.set()
        if old is not None and old.lost is None:
            old.abort(rx.ConnectionError("redis: replaced"))
        return protocol

    async def opened(self) -> None:
        """Wait until a connection is open (after a loss the attempts go on in the
        background until one opens); raises once the store is closed."""
        await self._open_now.wait()
        if self._closed:
            raise rx.ConnectionError("redis: store closed")

    async def close(self) -> None:
        self._closed = True
        self._open_now.set()  # whoever waits for a connection learns it is closed
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
        for retired in self._retired:
            retired.abort(rx.ConnectionError("redis: store closed"))
        self._retired = []
        if self._protocol is not None:
            self._protocol.abort(rx.ConnectionError("redis: store closed"))
            self._protocol = None
            self._writer = None
            await asyncio.sleep(0)  # the transport's connection_lost runs: the socket is closed


def _gathered(futures: list[asyncio.Future[Any]]) -> asyncio.Future[list[Any]]:
    """One future for the replies of ``futures`` (they complete in order, the last one last;
    a loss fails every one left), :data:`.wire.UNKNOWN` for each the connection lost."""
    out: asyncio.Future[list[Any]] = futures[-1].get_loop().create_future()

    def last_done(_: asyncio.Future[Any]) -> None:
        out.set_result([UNKNOWN if f.cancelled() or f.exception() is not None else f.result()
                        for f in futures])

    if futures[-1].done():
        last_done(futures[-1])
    else:
        futures[-1].add_done_callback(last_done)
    return out


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
