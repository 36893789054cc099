"""A server's HTTP/2 connection (RFC 9113), written by hand for the gRPC port.

What the python-hyper ``h2`` state machine did for ``server/grpc_h2.py``, without its cost per
frame (hyperframe's frame objects, h2's event objects, a stream state machine of seven
transitions per call, ``logging.debug`` per header: ~70 % of a no-op check's Python time under
h2load; docs/design.md, "The gRPC port on the event loop"). Frames are read and written with
``struct`` and slices; what is read is told to the owner (``_Connection``) by direct calls, not
events:

* ``request(sid, headers, end)`` a request's header block, ``data(sid, data, n, end)`` a DATA
  frame (``n`` its flow-controlled length), ``ended(sid)`` END_STREAM on HEADERS (after
  ``request``, trailers) or DATA, ``reset(sid, by_peer)`` the peer's RST_STREAM (or a stream error
  this connection raised on the stream), ``window(sid)`` a window widened (0: the connection's),
  ``settings()``/``ping()`` the peer spoke, ``peer_goaway()`` the peer's GOAWAY,
  ``inspect(type, sid, flags, arg)`` before each frame is handled (``arg``: a DATA frame's data
  length, a WINDOW_UPDATE's increment): it may raise :class:`H2Error` (the control budget).

The connection keeps: the preface and SETTINGS exchange (ACKs both ways), stream states (idle,
open, half-closed either side, closed; frames on closed streams ignored after our RST_STREAM,
else STREAM_CLOSED), stream ids only increasing and odd, header blocks with CONTINUATION (only
on their stream, bounded in encoded bytes and frames), padding, PRIORITY read and ignored, PING
answered, unknown frame types ignored, frame size (a frame header announcing more than
SETTINGS_MAX_FRAME_SIZE is refused at once) and each frame's fixed lengths, flow control both
ways (inbound windows reopened as the owner acknowledges bytes, outbound windows from the
peer's SETTINGS and WINDOW_UPDATEs, each bounded by 2^31-1), the peer's SETTINGS values checked
(RFC 9113 6.5.2). A connection error raises :class:`H2Error` with its code (the owner sends
GOAWAY and closes); a stream error is RST_STREAM here.

HPACK: header blocks are decoded by ``decode`` (one seam: a callable taking the block and
returning ``list[tuple[bytes, bytes]]``, raising on a bad block: by default
:func:`hpack_decoder`'s, :mod:`extauthz.server.hpackd`, HPACK decoded by hand, docs/design.md;
its table bound is the protocol's 4,096 until the peer acknowledges our SETTINGS, ours after).
Blocks are encoded without the dynamic table (:func:`encode_headers`:
literal, never indexed), so no encoder table is kept; a change of the peer's
SETTINGS_HEADER_TABLE_SIZE is answered by a table size update to 0 before the next block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from .hpackd import Decoder, HeaderListTooLarge

__all__ = ["PREFACE", "ErrorCode", "H2Conn", "H2Error", "Owner", "Stream", "encode_headers"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class ErrorCode:
    """RFC 9113 7's error codes."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


#: the names of the codes, by value
CODE_NAMES = {v: k for k, v in vars(ErrorCode).items() if k.isupper()}

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
MAX_WINDOW = (1 << 31) - 1
#: CONTINUATION frames one header block may have (hyperframe's bound, which h2 used)
MAX_CONTINUATIONS = 64
#: stream ids reset by this side remembered (frames the peer had in flight are then ignored)
_RESET_MEMORY = 1024

OPEN, HALF_CLOSED_REMOTE, HALF_CLOSED_LOCAL = 1, 2, 3


class H2Error(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with ``code``. ``reason`` names the bound
    for the owner's counters (``frame_too_large``, ``control_flood``, ...) or is ``None`` for a
    plain protocol error."""

    def __init__(self, code: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class Owner(Protocol):
    """What the connection tells of what it read (``_Connection`` in server/grpc_h2.py)."""

    def inspect(self, kind: int, sid: int, flags: int, arg: int) -> None: ...
    def request(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool) -> None: ...
    def trailers(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def data(self, sid: int, data: bytes, n: int, end: bool) -> None: ...
    def ended(self, sid: int) -> None: ...
    def reset(self, sid: int, by_peer: bool) -> None: ...
    def window(self, sid: int) -> None: ...
    def spoke(self) -> None: ...
    def peer_goaway(self) -> None: ...


class Stream:
    """One stream this side still sends or receives on."""

    __slots__ = ("processed", "recv_window", "send_window", "state")

    def __init__(self, state: int, send_window: int, recv_window: int) -> None:
        self.state = state
        self.send_window = send_window  # what we may still send
        self.recv_window = recv_window  # what the peer may still send
        self.processed = 0  # bytes received and acknowledged, not yet given back


def _int(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with an N-bit ``prefix``; ``first`` holds the high bits."""
    top = (1 << prefix) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block that touches no HPACK table: each field a literal never indexed with a
    literal name (RFC 7541 6.2.3), no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        out += b"\x10"
        out += _int(len(name), 7, 0)
        out += name
        out += _int(len(value), 7, 0)
        out += value
    return bytes(out)


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + sid.to_bytes(4, "big") + payload


def hpack_decoder(max_header_list_size: int, max_table_size: int) -> Decoder:
    """The header block decoder (the seam): :class:`~extauthz.server.hpackd.Decoder`, bounded
    (an oversized list raises :class:`~extauthz.server.hpackd.HeaderListTooLarge`); its table
    bound the protocol's initial 4,096 until :class:`H2Conn` lowers it to ``max_table_size``
    when the peer acknowledges our SETTINGS."""
    return Decoder(max_header_list_size=max_header_list_size, max_allowed_table_size=max(max_table_size, 4096))


class H2Conn:
    """The server side of one HTTP/2 connection: frames in (:meth:`receive`), frames out
    (``out``, taken by the owner), the streams' states and the windows both ways."""

    def __init__(self, owner: Owner, *, max_concurrent_streams: int, max_frame_size: int,
                 max_header_list_size: int, header_table_size: int, stream_window: int,
                 connection_window: int, max_block: int, stream_slack: int = 256,
                 decode: Callable[[bytes], list[tuple[bytes, bytes]]] | None = None) -> None:
        if not 16384 <= max_frame_size <= (1 << 24) - 1:
            raise ValueError(f"max_frame_size {max_frame_size} outside 16384..16777215")
        if not 65535 <= connection_window <= MAX_WINDOW or not 65535 <= stream_window <= MAX_WINDOW:
            # (a stream window below 65,535: the peer may fill 65,535 before it reads our SETTINGS)
            raise ValueError("windows outside 65535..2^31-1")
        self.owner = owner
        self.max_frame_size = max_frame_size
        self.max_block = max_block
        self.max_streams = max_concurrent_streams
        #: open streams past the advertised bound that a read may open before the owner refused
        #: them (a peer far past it is a connection error)
        self.hard_streams = max_concurrent_streams + stream_slack
        self.stream_window = stream_window
        self.connection_window = connection_window
        #: the decoder's table bound is the protocol's 4,096 until the peer acknowledged our
        #: SETTINGS (RFC 9113 6.5.3: blocks it encoded before it saw a smaller
        #: SETTINGS_HEADER_TABLE_SIZE are valid), ours after it
        self._decoder: Decoder | None = None
        self._table_size = header_table_size
        if decode is None:
            self._decoder = hpack_decoder(max_header_list_size, header_table_size)
            decode = self._decoder.decode
        self.decode = decode
        self.streams: dict[int, Stream] = {}
        self.reset_ids: dict[int, None] = {}  # streams this side reset (bounded, oldest first)
        self.highest_inbound_stream_id = 0
        #: the peer's settings this side sends by
        self.peer_initial_window = 65535
        self.max_outbound_frame_size = 16384
        self.outbound_flow_control_window = 65535
        #: what the peer may still send on the connection, and what was read and acknowledged
        self.recv_window = connection_window
        self.processed = 0
        self.table_update = b""  # a dynamic table size update owed before the next block
        self.out = bytearray()
        #: bytes read past the last whole frame, in the pieces they came in, and how many bytes
        #: complete the frame they begin (its header, else 9): a frame trickled in small reads
        #: is joined once when whole, not copied again at each read (quadratic in its size)
        self._parts: list[bytes] = []
        self._have = 0
        self._need = 0
        #: set by the owner once it ends the connection: what is left unread is not handled
        self.halted = False
        self._preface = False
        self._settings_seen = False
        #: a header block being received: its stream, flags, fragments, encoded size, frames
        self.block_sid = 0
        self._block_flags = 0
        self._block: list[bytes] = []
        self._block_size = 0
        self._block_frames = 0
        self.out += _frame(SETTINGS, 0, 0, b"".join(
            k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
                (S_HEADER_TABLE_SIZE, header_table_size), (S_ENABLE_PUSH, 0),
                (S_MAX_CONCURRENT_STREAMS, max_concurrent_streams), (S_INITIAL_WINDOW_SIZE, stream_window),
                (S_MAX_FRAME_SIZE, max_frame_size), (S_MAX_HEADER_LIST_SIZE, max_header_list_size))))
        if connection_window > 65535:
            self.out += _frame(WINDOW_UPDATE, 0, 0, (connection_window - 65535).to_bytes(4, "big"))

    # -- reading
    @property
    def unparsed(self) -> int:
        """Bytes read and not yet parsed into a frame."""
        return self._have

    def receive(self, data: bytes) -> None:
        """Read ``data``: every whole frame is handled (the owner told) in order. Raises
        :class:`H2Error` on a connection error (what was handled before it stands)."""
        if self._have:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:
                return
            buf = b"".join(self._parts)
        else:
            buf = data
        if not self._preface:
            n = min(len(buf), 24)
            if buf[:n] != PREFACE[:n]:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "invalid connection preface")
            if len(buf) < 24:
                self._parts, self._have, self._need = [buf], len(buf), 0  # checked at each read
                return
            self._preface = True
            buf = buf[24:]
        pos, end = 0, len(buf)
        limit = self.max_frame_size
        try:
            while end - pos >= 9 and not self.halted:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > limit:
                    raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes past {limit}",
                                  "frame_too_large")
                if end - pos - 9 < length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = buf[pos + 9:pos + 9 + length]
                pos += 9 + length
                self._frame_in(kind, flags, sid, payload)
        finally:
            if pos < end:
                rest = buf[pos:]
                self._parts, self._have = [rest], end - pos
                # a header read (and its length checked above): the frame's whole size
                self._need = 9 + ((rest[0] << 16) | (rest[1] << 8) | rest[2]) if end - pos >= 9 else 9
            else:
                self._parts, self._have = [], 0

    def _frame_in(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "the client preface's first frame must be SETTINGS")
            self._settings_seen = True
        if self.block_sid and (kind != CONTINUATION or sid != self.block_sid):
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "a header block interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload, flags)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == PING:
            self.owner.inspect(kind, sid, flags, 0)
            if len(payload) != 8:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PING of other than 8 bytes")
            if sid:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if not flags & ACK:
                self.out += _frame(PING, ACK, 0, payload)
            self.owner.spoke()
        elif kind == RST_STREAM:
            self._rst_stream(sid, payload, flags)
        elif kind == PRIORITY:
            self.owner.inspect(kind, sid, flags, 0)
            if not sid:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:  # as on HEADERS (5.3.1, 5.4.1)
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"stream {sid} depends on itself")
        elif kind == GOAWAY:
            self.owner.inspect(kind, sid, flags, 0)
            if sid:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY of fewer than 8 bytes")
            self.owner.peer_goaway()
        elif kind == PUSH_PROMISE:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:  # unknown types are ignored (RFC 9113 5.5), within the control budget
            self.owner.inspect(kind, sid, flags, 0)

    @staticmethod
    def _unpad(flags: int, payload: bytes, what: str) -> tuple[bytes, int]:
        """The payload without its padding, and the pad length byte's offset past it."""
        if not flags & PADDED:
            return payload, 0
        if not payload:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"padded {what} without a pad length")
        pad = payload[0]
        if pad >= len(payload):
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"{what} padding as long as its payload")
        return payload[1:len(payload) - pad], 1

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        n = len(payload)
        data, _ = self._unpad(flags, payload, "DATA")
        self.owner.inspect(DATA, sid, flags, len(data))
        if not sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        if sid > self.highest_inbound_stream_id or not sid & 1:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        self.recv_window -= n
        if self.recv_window < 0:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the connection window")
        stream = self.streams.get(sid)
        if stream is None or stream.state == HALF_CLOSED_REMOTE:
            self.acknowledge_received_data(n, 0)  # nobody reads it: the connection credited
            if sid not in self.reset_ids:
                self._stream_error(sid, ErrorCode.STREAM_CLOSED)
            return
        stream.recv_window -= n
        if stream.recv_window < 0:
            self.acknowledge_received_data(n, 0)
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        end = bool(flags & END_STREAM)
        self.owner.data(sid, data, n, end)
        if end and sid in self.streams:
            self._remote_ended(sid, self.streams[sid])

    def _remote_ended(self, sid: int, stream: Stream) -> None:
        if stream.state == OPEN:
            stream.state = HALF_CLOSED_REMOTE
        else:
            del self.streams[sid]
        self.owner.ended(sid)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        self.owner.inspect(HEADERS, sid, flags, 0)
        if not sid & 1:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid} (not a client's odd id)")
        fragment, _ = self._unpad(flags, payload, "HEADERS")
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if int.from_bytes(fragment[:4], "big") & 0x7FFFFFFF == sid:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"stream {sid} depends on itself")
            fragment = fragment[5:]
        if len(fragment) > self.max_block:
            raise self._oversized()
        if flags & END_HEADERS:
            self._block_done(sid, flags, fragment)
            return
        self.block_sid, self._block_flags = sid, flags
        self._block = [fragment]
        self._block_size = len(fragment)
        self._block_frames = 0

    def _oversized(self) -> H2Error:
        return H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"header block of more than {self.max_block} encoded bytes")

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        self.owner.inspect(CONTINUATION, sid, flags, 0)
        if not self.block_sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        self._block_size += len(payload)
        if self._block_size > self.max_block:
            raise self._oversized()
        self._block_frames += 1
        if self._block_frames > MAX_CONTINUATIONS:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"more than {MAX_CONTINUATIONS} CONTINUATION frames")
        self._block.append(payload)
        if flags & END_HEADERS:
            block = b"".join(self._block)
            self.block_sid, self._block = 0, []
            self._block_done(sid, self._block_flags, block)

    def _block_done(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self.decode(block)
        except HeaderListTooLarge as exc:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"header list too large: {exc}") from exc
        except Exception as exc:  # the decoder's any failure: the block does not decode (4.3)
            raise H2Error(ErrorCode.COMPRESSION_ERROR, f"header block does not decode: {exc}") from exc
        end = bool(flags & END_STREAM)
        if sid > self.highest_inbound_stream_id:
            if len(self.streams) >= self.hard_streams:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"more than {self.hard_streams} streams open")
            self.highest_inbound_stream_id = sid
            self.streams[sid] = Stream(HALF_CLOSED_REMOTE if end else OPEN, self.peer_initial_window,
                                       self.stream_window)
            self.owner.request(sid, headers, end)
            if end and sid in self.streams:
                self.owner.ended(sid)
            return
        old = self.streams.get(sid)  # trailers on a stream still open, else closed or reused
        if old is None or old.state == HALF_CLOSED_REMOTE:
            if sid in self.reset_ids:
                return
            if old is None:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}: ids only increase")
            self._stream_error(sid, ErrorCode.STREAM_CLOSED)
            return
        if not end:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
        self.owner.trailers(sid, headers)
        if sid in self.streams:
            self._remote_ended(sid, old)

    def _window_update(self, sid: int, payload: bytes, flags: int) -> None:
        if len(payload) != 4:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        self.owner.inspect(WINDOW_UPDATE, sid, flags, inc)
        if not sid:
            if not inc:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "connection WINDOW_UPDATE of 0")
            self.outbound_flow_control_window += inc
            if self.outbound_flow_control_window > MAX_WINDOW:
                raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "connection window past 2^31-1")
            self.owner.window(0)
            return
        if sid > self.highest_inbound_stream_id or not sid & 1:  # an even id: a stream we never open
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        stream = self.streams.get(sid)
        if stream is None:
            return  # closed: ignored
        if not inc:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
            return
        stream.send_window += inc
        if stream.send_window > MAX_WINDOW:
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        self.owner.window(sid)

    def _rst_stream(self, sid: int, payload: bytes, flags: int) -> None:
        self.owner.inspect(RST_STREAM, sid, flags, 0)
        if len(payload) != 4:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
        if sid > self.highest_inbound_stream_id or not sid & 1:  # 0, or even: a stream we never open
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        if self.streams.pop(sid, None) is not None:
            self.owner.reset(sid, True)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        self.owner.inspect(SETTINGS, sid, flags, 0)
        if sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            if self._decoder is not None:  # our SETTINGS (sent once) now bind the peer's encoder
                self._decoder.max_allowed_table_size = self._table_size
            return
        if len(payload) % 6:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        # SETTINGS_INITIAL_WINDOW_SIZE is taken in order, but the open streams' windows move
        # once per frame, not once per entry (a frame of 2,730 entries times the open streams
        # was a CPU bound the control budget did not see): by the last value, a window past
        # 2^31-1 at the frame's largest value still an error (RFC 9113 6.9.2)
        initial = highest = self.peer_initial_window
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value} past 2^31-1")
                initial = value
                highest = max(highest, value)
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= (1 << 24) - 1:
                    raise H2Error(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
                self.max_outbound_frame_size = value
            elif key == S_ENABLE_PUSH:
                if value > 1:
                    raise H2Error(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value} out of range")
            elif key == S_HEADER_TABLE_SIZE:
                self.table_update = b"\x20"  # a size update to 0: within any value (we index nothing)
        delta = initial - self.peer_initial_window
        if highest > self.peer_initial_window or delta:
            rise = highest - self.peer_initial_window
            self.peer_initial_window = initial
            for stream in self.streams.values():
                if stream.send_window + rise > MAX_WINDOW:
                    raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
                stream.send_window += delta
        self.out += b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"  # SETTINGS ACK
        self.owner.spoke()
        if delta > 0:
            self.owner.window(0)

    # -- inbound flow control
    def acknowledge_received_data(self, n: int, sid: int) -> None:
        """``n`` flow-controlled bytes of stream ``sid`` were consumed (or dropped): the windows
        reopen (a WINDOW_UPDATE once half a window was consumed, or the window ran dry)."""
        if n <= 0:
            return
        self.processed += n
        if self.processed >= self.connection_window // 2 or (
                self.recv_window <= 0 and self.processed > min(1024, self.connection_window // 4)):
            inc = min(self.processed, self.connection_window - self.recv_window)
            if inc > 0:
                self.recv_window += inc
                self.out += _frame(WINDOW_UPDATE, 0, 0, inc.to_bytes(4, "big"))
            self.processed = 0
        if not sid:
            return
        stream = self.streams.get(sid)
        if stream is None or stream.state == HALF_CLOSED_REMOTE:
            return  # the peer sends no more on it
        stream.processed += n
        full = self.stream_window
        if stream.processed >= full // 2 or (stream.recv_window <= 0 and stream.processed > min(1024, full // 4)):
            inc = min(stream.processed, full - stream.recv_window)
            if inc > 0:
                stream.recv_window += inc
                self.out += _frame(WINDOW_UPDATE, 0, sid, inc.to_bytes(4, "big"))
            stream.processed = 0

    @property
    def inbound_window(self) -> tuple[int, int]:
        """The connection's receive window and the bytes consumed not yet given back to it."""
        return self.recv_window, self.processed

    # -- writing
    def sendable(self, sid: int) -> Stream | None:
        """Stream ``sid`` if this side may still send on it (its ``send_window`` and
        :attr:`outbound_flow_control_window` bound its DATA), else None."""
        stream = self.streams.get(sid)
        return stream if stream is not None and stream.state != HALF_CLOSED_LOCAL else None

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """A header block (encoded) on ``sid``, in CONTINUATIONs past the peer's frame size.
        KeyError if the stream cannot send."""
        stream = self.streams.get(sid)
        if stream is None or stream.state == HALF_CLOSED_LOCAL:
            raise KeyError(sid)
        if self.table_update:
            block = self.table_update + block
            self.table_update = b""
        size = self.max_outbound_frame_size
        flags = END_STREAM if end_stream else 0
        if len(block) <= size:
            self.out += _frame(HEADERS, flags | END_HEADERS, sid, block)
        else:
            self.out += _frame(HEADERS, flags, sid, block[:size])
            for i in range(size, len(block), size):
                last = i + size >= len(block)
                self.out += _frame(CONTINUATION, END_HEADERS if last else 0, sid, block[i:i + size])
        if end_stream:
            self.local_ended(sid, stream)

    def local_ended(self, sid: int, stream: Stream) -> None:
        """This side sent END_STREAM on ``sid``."""
        if stream.state == HALF_CLOSED_REMOTE:
            del self.streams[sid]
        else:
            stream.state = HALF_CLOSED_LOCAL

    def send_data(self, sid: int, data: bytes | bytearray | memoryview) -> None:
        """DATA within the windows (the caller checked them and the peer's frame size)."""
        stream = self.streams[sid]
        n = len(data)
        stream.send_window -= n
        self.outbound_flow_control_window -= n
        self.out += bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, DATA, 0))
        self.out += sid.to_bytes(4, "big")
        self.out += data

    def reset_stream(self, sid: int, code: int) -> bool:
        """RST_STREAM ``code`` on ``sid`` unless it is closed already; whether one was sent."""
        if self.streams.pop(sid, None) is None:
            return False
        self._sent_reset(sid, code)
        return True

    def _sent_reset(self, sid: int, code: int) -> None:
        self.out += _frame(RST_STREAM, 0, sid, code.to_bytes(4, "big"))
        reset = self.reset_ids
        reset[sid] = None
        if len(reset) > _RESET_MEMORY:
            del reset[next(iter(reset))]

    def _stream_error(self, sid: int, code: int) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM, and the owner told as of a reset."""
        known = self.streams.pop(sid, None) is not None
        self._sent_reset(sid, code)
        if known:
            self.owner.reset(sid, False)

    def goaway_frame(self, code: int) -> bytes:
        return _frame(GOAWAY, 0, 0, self.highest_inbound_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big"))

    def data_to_send(self) -> bytes:
        out = bytes(self.out)
        self.out.clear()
        return out
