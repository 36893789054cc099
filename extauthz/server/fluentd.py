"""The fluentd release port: Envoy's fluentd access logger (``envoy.access_loggers.fluentd``)
hands finished requests back over the Fluentd Forward protocol (v1), msgpack over plain TCP.

The cheaper release path where no Istio provider forces the gRPC stream (docs/design.md "The
release path"). Each connection feeds a bounded :class:`msgpack.Unpacker`; every entry's
fields go to the entry handling shared with the gRPC access log
(:class:`~extauthz.server.leases.FinishedEntries`). Envoy sends Forward mode
``[tag, [[time, record], ...]]``; Message mode ``[tag, time, record]`` and PackedForward
``[tag, <msgpack entries as bin>]`` are read too, and an ``option`` map's ``chunk`` is answered
``{"ack": chunk}`` (Envoy 1.40 asks for none).

The record is what ``extauthz envoy-config --access-log fluentd`` renders
(:data:`extauthz.envoy.records.FLUENTD_RECORD`): the request id, the ext_authz
dynamic-metadata namespace as a nested map, the response flags (``UAEX``: refused by the
authorization filter), what the check saw of the request (start time in microseconds, method,
path, original path: the request-id index's ``seen``), the duration in milliseconds
(``serve --record``), and Envoy's fail-open header with the authority: a request Envoy let
through unchecked is counted by the tier its method, path and host give (the tier rules'
headers and the route's tier are not in this record; the gRPC access log carries them).

Trust: the port releases leases, so it is as trusted as the gRPC access-log port: bind it to
localhost or the pod (docs/security.md); the lease tickets are vetted as on the gRPC stream.
Bounds: one message at most ``max_message_bytes`` (one of up to 3/4 of it is always read) and
``max_entries`` entries, at most ``max_connections`` connections; input that is not a
Forward-protocol message (bad msgpack, a wrong shape, compressed PackedForward, a bound
passed) closes its connection and is counted by reason; nothing after the bad message is read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any, cast

import msgpack

from ..core.context import RawRequest
from ..envoy.records import IN_FLIGHT_TYPES, UNAUTHORIZED_FLAG
from .leases import MAX_PENDING_RELEASES, FinishedEntries, seen_as, seen_at
from .ports import parse_listen

__all__ = ["FluentdLimits", "FluentdReceiver", "MalformedMessage", "entries_of"]

log = logging.getLogger("extauthz.fluentd")

#: reasons a connection was closed (status ``malformed``)
REASONS = ("msgpack", "shape", "too_large", "compressed", "too_many_connections")


class MalformedMessage(ValueError):
    """A message that is not a Forward-protocol message this port reads; ``reason``: one of
    :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class FluentdLimits:
    """The port's bounds."""

    __slots__ = ("max_connections", "max_entries", "max_message_bytes")

    def __init__(self, max_message_bytes: int = 1 << 20, max_entries: int = 10_000,
                 max_connections: int = 256) -> None:
        if min(max_message_bytes, max_entries, max_connections) < 1:
            raise ValueError("fluentd limits must be at least 1")
        self.max_message_bytes = max_message_bytes
        self.max_entries = max_entries
        self.max_connections = max_connections


def _unpacker(limits: FluentdLimits) -> msgpack.Unpacker:
    n = limits.max_message_bytes
    return msgpack.Unpacker(raw=False, max_buffer_size=n, max_str_len=n, max_bin_len=n,
                            max_array_len=limits.max_entries, max_map_len=256, max_ext_len=64)


def entries_of(message: object, limits: FluentdLimits) -> tuple[list[tuple[object, Mapping[str, Any]]],
                                                                  Mapping[str, Any] | None]:
    """The (time, record) entries of one Forward-protocol message and its option map (None:
    none), or :class:`MalformedMessage`. Every entry is checked before any is used."""
    if not isinstance(message, (list, tuple)) or not 2 <= len(message) <= 4 or not isinstance(message[0], str):
        raise MalformedMessage("shape", "not a [tag, ...] array")
    body = message[1]
    rest = list(message[2:])
    entries: list[Any]
    if isinstance(body, (list, tuple)):  # Forward mode
        entries = list(body)
    elif isinstance(body, (bytes, str)):  # PackedForward: a msgpack stream of entries
        option = rest[0] if rest else None
        if isinstance(option, Mapping) and option.get("compressed") not in (None, "text"):
            raise MalformedMessage("compressed", "CompressedPackedForward is not read")
        unpacker = _unpacker(limits)
        try:
            unpacker.feed(body.encode() if isinstance(body, str) else body)
            entries = []
            for e in unpacker:
                entries.append(e)
                if len(entries) > limits.max_entries:
                    raise MalformedMessage("too_large", f"more than {limits.max_entries} entries")
        except (ValueError, msgpack.UnpackException) as exc:
            if isinstance(exc, MalformedMessage):
                raise
            raise MalformedMessage("too_large" if "exceeds max" in str(exc) else "msgpack",
                                   f"bad packed entries: {exc}") from exc
    else:  # Message mode: [tag, time, record, option?]
        if not rest:
            raise MalformedMessage("shape", "a Message-mode message without its record")
        entries = [(body, rest.pop(0))]
    if len(rest) > 1:
        raise MalformedMessage("shape", "more than one option map")
    option = rest[0] if rest else None
    if option is not None and not isinstance(option, Mapping):
        raise MalformedMessage("shape", "the option is not a map")
    if len(entries) > limits.max_entries:
        raise MalformedMessage("too_large", f"more than {limits.max_entries} entries")
    out: list[tuple[object, Mapping[str, Any]]] = []
    for e in entries:
        if not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[1], Mapping):
            raise MalformedMessage("shape", "an entry is not [time, record]")
        out.append((e[0], e[1]))
    return out, option


def _seen(record: Mapping[str, Any]) -> tuple[str, ...]:
    """What a record says of its request, in :meth:`LeaseIndex.take`'s terms."""
    seen: list[str] = []
    start = record.get("start_us")
    if isinstance(start, (int, str)) and not isinstance(start, bool):
        try:
            seen.append(seen_at(int(start)))
        except ValueError:
            pass
    method = record.get("method")
    if isinstance(method, str):
        for key in ("path", "original_path"):
            path = record.get(key)
            if isinstance(path, str) and path and path != "-":
                seen.append(seen_as(method, path))
    return tuple(seen)


def _duration(record: Mapping[str, Any]) -> float | None:
    ms = record.get("duration_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        return ms / 1000.0
    if isinstance(ms, str) and ms.isdigit():
        return int(ms) / 1000.0
    return None


def _given(value: object) -> str:
    """A ``%REQ(...)%`` field's value ("" for Envoy's ``-``: no such header)."""
    return value if isinstance(value, str) and value != "-" else ""


def _request(record: Mapping[str, Any]) -> RawRequest:
    """What a record shows of its request for the classifier (no headers, no route tier)."""
    return RawRequest(_given(record.get("method")), _given(record.get("path")), _given(record.get("authority")))


def _unauthorized(flags: object) -> bool:
    return isinstance(flags, str) and UNAUTHORIZED_FLAG in flags.split(",")


class FluentdReceiver:
    """The fluentd port: a TCP server whose connections read Forward-protocol messages."""

    def __init__(self, finished: FinishedEntries, limits: FluentdLimits | None = None) -> None:
        self.finished = finished
        self.limits = limits if limits is not None else FluentdLimits()
        self.server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        self.messages = 0
        self.acks = 0
        #: connections closed on bad input or a bound, by reason (:data:`REASONS`)
        self.malformed: dict[str, int] = {}

    async def start(self, listen: str, *, reuse_port: bool = False) -> int:
        """Listen on ``listen`` (host:port); the port bound."""
        host, port = parse_listen(listen)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                               reuse_port=reuse_port or None)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self, within: float | None = None) -> None:
        """Stop listening, close the connections and wait for their releases, up to
        ``within`` s (None: until they end; a graceful stop passes what is left of its budget,
        and releases still running then are the release drain's, then the leases' TTL's)."""
        if self.server is not None:
            self.server.close()
        pending: set[asyncio.Future[Any]] = set()
        for conn in list(self.connections):
            pending |= conn.pending
            if conn.transport is not None:
                conn.transport.close()
        if pending:
            _, late = await asyncio.wait(pending, timeout=within)
            if late:
                log.warning("fluentd port: %d releases still running at the end of the stop budget", len(late),
                            extra={"fields": {"event": "fluentd_stop_late", "releases": len(late)}})
        if self.server is not None:
            await self.server.wait_closed()

    def status(self) -> dict[str, Any]:
        return {"connections": len(self.connections), "messages": self.messages, "acks": self.acks,
                "malformed": dict(sorted(self.malformed.items()))}

    def count(self, reason: str) -> None:
        self.malformed[reason] = self.malformed.get(reason, 0) + 1


class _Connection(asyncio.Protocol):
    def __init__(self, receiver: FluentdReceiver) -> None:
        self.receiver = receiver
        self.unpacker = _unpacker(receiver.limits)
        self._step = max(1, receiver.limits.max_message_bytes // 4)
        self.transport: asyncio.Transport | None = None
        self.pending: set[asyncio.Future[Any]] = set()
        self.paused = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        receiver = self.receiver
        if len(receiver.connections) >= receiver.limits.max_connections:
            self._refuse("too_many_connections", "too many connections")
            return
        receiver.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.receiver.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        receiver = self.receiver
        # fed in slices of a quarter of the bound, each read out before the next: a message
        # of up to 3/4 of max_message_bytes is always read whatever the reads bring with it,
        # one over max_message_bytes never
        step = self._step
        try:
            for i in range(0, len(data), step):
                self.unpacker.feed(data[i:i + step] if len(data) > step else data)
                for message in self.unpacker:
                    entries, option = entries_of(message, receiver.limits)
                    receiver.messages += 1
                    self._read(entries)
                    chunk = option.get("chunk") if option is not None else None
                    if chunk is not None and self.transport is not None:
                        self.transport.write(msgpack.packb({"ack": chunk}))
                        receiver.acks += 1
                if self.closed:
                    return
        except MalformedMessage as exc:
            self._refuse(exc.reason, str(exc))
        except msgpack.BufferFull:
            self._refuse("too_large", f"a message over {receiver.limits.max_message_bytes} bytes")
        except (ValueError, msgpack.UnpackException) as exc:  # bad msgpack, a bound, bad UTF-8
            self._refuse("too_large" if "exceeds max" in str(exc) else "msgpack", f"{type(exc).__name__}: {exc}")

    def _read(self, entries: list[tuple[object, Mapping[str, Any]]]) -> None:
        finished = self.receiver.finished
        for _time, record in entries:
            finished.entries += 1
            rid = _given(record.get("request_id"))
            md = record.get("ext_authz")
            metadata = md if isinstance(md, Mapping) else None
            failed_open = bool(_given(record.get("failure_mode_allowed")))
            task: asyncio.Future[Any] | None
            if record.get("log_type") in IN_FLIGHT_TYPES:  # not finished: nothing to release
                task = finished.in_flight(rid, metadata, failed_open=failed_open, request=partial(_request, record))
            else:
                task = finished.entry(rid, metadata, unauthorized=_unauthorized(record.get("response_flags")),
                                      seen=partial(_seen, record), duration=partial(_duration, record),
                                      failed_open=failed_open, request=partial(_request, record))
            if task is None:
                continue
            self.pending.add(task)
            task.add_done_callback(self._released)
            if len(self.pending) >= MAX_PENDING_RELEASES and not self.paused and self.transport is not None:
                self.paused = True  # a slow store: stop reading until half the releases are done
                self.transport.pause_reading()

    def _released(self, task: asyncio.Future[Any]) -> None:
        self.pending.discard(task)
        if self.paused and len(self.pending) <= MAX_PENDING_RELEASES // 2:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _refuse(self, reason: str, detail: str) -> None:
        self.receiver.count(reason)
        self.closed = True
        log.warning("fluentd port: closing a connection: %s", detail,
                    extra={"fields": {"event": "fluentd_malformed", "reason": reason}})
        if self.transport is not None:
            self.transport.close()

