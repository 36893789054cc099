"""The gRPC port's HTTP/2 connection written by hand (server/h2conn.py): the protocol rules
the h2 library enforced for the server and no other test sent, each with RFC 9113's error
code, and the connection still serving (or a fresh one served) after each.

Raw frames (hyperframe, hpack) and the helpers of test_grpc_h2_server.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from h2.errors import ErrorCodes
from hpack import Decoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from extauthz.server.grpc_h2 import GrpcH2Server, H2Limits
from extauthz.server.h2conn import encode_headers

from .test_grpc_h2_server import LIMITS, PREFACE, Probe, Raw, _serve, answers, probe

__all__ = ["probe"]  # the fixture, used by name


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


async def _ends_with(raw: Raw, code: ErrorCodes) -> None:
    away = await raw.goaway()
    assert away.error_code == code, away
    await raw.ended()


async def test_headers_on_an_even_stream_id_end_the_connection(probe: tuple[GrpcH2Server, Probe]) -> None:
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.send(HeadersFrame(2, raw.block(), flags=["END_HEADERS", "END_STREAM"]))
    await _ends_with(raw, ErrorCodes.PROTOCOL_ERROR)
    assert srv.rejected["protocol_error"] == 1
    await answers(srv.port)


@pytest.mark.parametrize(("setting", "value", "code"), [
    (SettingsFrame.INITIAL_WINDOW_SIZE, 1 << 31, ErrorCodes.FLOW_CONTROL_ERROR),
    (SettingsFrame.MAX_FRAME_SIZE, 16383, ErrorCodes.PROTOCOL_ERROR),
    (SettingsFrame.MAX_FRAME_SIZE, 1 << 24, ErrorCodes.PROTOCOL_ERROR),
    (SettingsFrame.ENABLE_PUSH, 2, ErrorCodes.PROTOCOL_ERROR),
])
async def test_a_settings_value_out_of_range_ends_the_connection(
        probe: tuple[GrpcH2Server, Probe], setting: int, value: int, code: ErrorCodes) -> None:
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.send(SettingsFrame(0, settings={setting: value}))
    await _ends_with(raw, code)
    await answers(srv.port)


async def test_settings_in_range_are_taken(probe: tuple[GrpcH2Server, Probe]) -> None:
    """Unknown settings are ignored; a bigger peer frame size lets an answer out in one DATA
    frame; each SETTINGS is acknowledged."""
    srv, _ = probe
    raw = await Raw.open(srv.port, settings={SettingsFrame.MAX_FRAME_SIZE: 65536,
                                             SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20, 0x99: 7})
    raw.send(WindowUpdateFrame(0, window_increment=1 << 20))
    raw.call(1, b"40000", path="/t.T/Big")
    assert (await raw.trailers(1))["grpc-status"] == "0"
    data = [f for f in raw.frames if isinstance(f, DataFrame)]
    assert [len(f.data) for f in data] == [40005]
    assert sum(1 for f in raw.frames if isinstance(f, SettingsFrame) and "ACK" in f.flags) == 1


async def test_a_connection_window_past_the_maximum_ends_the_connection(
        probe: tuple[GrpcH2Server, Probe]) -> None:
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.send(WindowUpdateFrame(0, window_increment=(1 << 31) - 1))  # 65535 + that > 2^31-1
    await _ends_with(raw, ErrorCodes.FLOW_CONTROL_ERROR)
    await answers(srv.port)


async def test_a_stream_window_past_the_maximum_resets_the_stream(probe: tuple[GrpcH2Server, Probe]) -> None:
    srv, p = probe
    raw = await Raw.open(srv.port)
    raw.call(1, path="/t.T/Hang")
    raw.send(WindowUpdateFrame(1, window_increment=(1 << 31) - 1))
    reset = await raw.until(lambda f: isinstance(f, RstStreamFrame))
    assert reset.stream_id == 1 and reset.error_code == ErrorCodes.FLOW_CONTROL_ERROR  # type: ignore[attr-defined]
    raw.call(3)  # the connection serves on
    assert (await raw.trailers(3))["grpc-status"] == "0"
    assert p.hanging == 0  # the reset stream's handler was cancelled


@pytest.mark.parametrize("sid", [0, 1])
async def test_a_window_update_of_zero(probe: tuple[GrpcH2Server, Probe], sid: int) -> None:
    """0 on the connection is a connection error, on a stream a stream error (6.9)."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    if sid:
        raw.call(1, path="/t.T/Hang")
    raw.write(_frame(8, 0, sid, b"\x00\x00\x00\x00"))
    if not sid:
        await _ends_with(raw, ErrorCodes.PROTOCOL_ERROR)
        return
    reset = await raw.until(lambda f: isinstance(f, RstStreamFrame))
    assert reset.stream_id == 1 and reset.error_code == ErrorCodes.PROTOCOL_ERROR  # type: ignore[attr-defined]
    raw.call(3)
    assert (await raw.trailers(3))["grpc-status"] == "0"


async def test_data_on_a_stream_the_server_reset_is_ignored_and_credited(
        probe: tuple[GrpcH2Server, Probe]) -> None:
    """DATA the peer had in flight on a stream the server reset (here refused: the stream
    bound) is dropped without another RST_STREAM, and its bytes reopen the connection window."""
    srv, p = probe
    raw = await Raw.open(srv.port)
    for sid in (1, 3, 5, 7):
        raw.call(sid, path="/t.T/Hang")
    raw.send(HeadersFrame(9, raw.block("/t.T/Hang"), flags=["END_HEADERS"]))
    refused = await raw.until(lambda f: isinstance(f, RstStreamFrame))
    assert refused.stream_id == 9 and refused.error_code == ErrorCodes.REFUSED_STREAM  # type: ignore[attr-defined]
    raw.send(DataFrame(9, b"\x00" * 16000), DataFrame(9, b"\x00" * 100, flags=["END_STREAM"]))
    p.release.set()
    for sid in (1, 3, 5, 7):
        assert (await raw.trailers(sid))["grpc-status"] == "0"
    raw.call(11)
    assert (await raw.trailers(11))["grpc-status"] == "0"
    assert [f.stream_id for f in raw.frames if isinstance(f, RstStreamFrame)] == [9]
    conn = next(iter(srv.connections))
    window, processed = conn.h2.inbound_window
    assert window + processed == srv.limits.connection_window


@pytest.mark.parametrize("case", ["interrupted", "continuation_alone", "trailers_open", "ping_length",
                                  "rst_length", "push_promise", "settings_ack_payload", "data_on_0",
                                  "headers_pad"])
async def test_framing_violations_end_the_connection(probe: tuple[GrpcH2Server, Probe], case: str) -> None:
    srv, _ = probe
    raw = await Raw.open(srv.port)
    block = raw.block() if case != "rst_length" else b""  # (encoded only when sent: HPACK's state)
    code = ErrorCodes.PROTOCOL_ERROR
    if case == "interrupted":  # a header block cut by another frame
        raw.send(HeadersFrame(1, block[:4]), PingFrame(0, opaque_data=b"12345678"),
                 ContinuationFrame(1, block[4:], flags=["END_HEADERS"]))
    elif case == "continuation_alone":
        raw.send(ContinuationFrame(1, block, flags=["END_HEADERS"]))
    elif case == "trailers_open":  # trailers must end the stream
        raw.send(HeadersFrame(1, block, flags=["END_HEADERS"]),
                 HeadersFrame(1, raw.encoder.encode([("x-t", "1")]), flags=["END_HEADERS"]))
    elif case == "ping_length":
        raw.write(_frame(6, 0, 0, b"1234567"))
        code = ErrorCodes.FRAME_SIZE_ERROR
    elif case == "rst_length":
        raw.call(1, path="/t.T/Hang")
        raw.write(_frame(3, 0, 1, b"\x00\x00\x08"))
        code = ErrorCodes.FRAME_SIZE_ERROR
    elif case == "push_promise":
        raw.write(_frame(5, 4, 1, b"\x00\x00\x00\x02" + block))
    elif case == "settings_ack_payload":
        raw.write(_frame(4, 1, 0, b"\x00\x03\x00\x00\x00\x01"))
        code = ErrorCodes.FRAME_SIZE_ERROR
    elif case == "data_on_0":
        raw.write(_frame(0, 0, 0, b"x"))
    else:  # padding as long as the payload
        raw.write(_frame(1, 0x4 | 0x8, 1, bytes((len(block) + 1,)) + block))
    await _ends_with(raw, code)
    await answers(srv.port)


async def test_a_smaller_peer_header_table_is_signalled(probe: tuple[GrpcH2Server, Probe]) -> None:
    """After the peer's SETTINGS_HEADER_TABLE_SIZE changes, the next header block starts with a
    dynamic table size update (RFC 7541 4.2) that its decoder takes; the answers decode."""
    srv, _ = probe
    raw = await Raw.open(srv.port, settings={SettingsFrame.HEADER_TABLE_SIZE: 0})
    raw.decoder.max_allowed_table_size = 0  # a peer that holds to its setting
    raw.call(1)
    assert (await raw.trailers(1))["grpc-status"] == "0"
    first = next(f for f in raw.frames if isinstance(f, HeadersFrame) and f.stream_id == 1)
    assert first.data[:1] == b"\x20"  # type: ignore[attr-defined]
    raw.call(3)
    assert (await raw.trailers(3))["grpc-status"] == "0"


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 300, 20000])
def test_encoded_headers_decode(size: int) -> None:
    """The answers' header blocks (literal, never indexed, no Huffman) decode in the hpack
    library's decoder, long names and values (multi-byte lengths) included, and index nothing."""
    headers = [(b"grpc-status", b"13"), (b"x" * max(size, 1), b"v" * size), (b"grpc-message", b"a%20b")]
    decoder = Decoder()
    decoder.max_header_list_size = 1 << 20
    assert decoder.decode(encode_headers(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0


def test_the_server_runs_without_h2() -> None:
    """No h2 and no hyperframe on any path of the gRPC port: importing the server and the app
    that builds it loads neither (the tests' raw client and bench's ``h2`` candidate use them)."""
    code = ("import sys; import extauthz.server.app, extauthz.server.grpc_h2; "
            "print(sorted(m for m in ('h2', 'hyperframe') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


class _Walked(dict[int, object]):
    """A stream map that counts the walks over its streams."""

    walks = 0

    def values(self):  # type: ignore[override]
        self.walks += 1
        return super().values()


async def _ping(raw: Raw, opaque: bytes = b"syncsync") -> None:
    """Everything sent before was read by the server: its answer to a PING came back."""
    raw.send(PingFrame(0, opaque_data=opaque))
    await raw.until(lambda f: isinstance(f, PingFrame) and "ACK" in f.flags and f.opaque_data == opaque)


def _settings(*pairs: tuple[int, int]) -> bytes:
    return _frame(4, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs))


async def test_a_settings_frame_of_many_window_sizes_moves_the_open_windows_once(
        probe: tuple[GrpcH2Server, Probe]) -> None:
    """A SETTINGS frame of 2,730 INITIAL_WINDOW_SIZE entries (16 KiB) walked every open stream
    per entry (one frame of the control budget: ~65 ms of CPU with 356 streams): the windows
    move once, by the last value (RFC 9113 6.5.3: values in order)."""
    srv, p = probe
    raw = await Raw.open(srv.port)
    for sid in (1, 3, 5):
        raw.call(sid, path="/t.T/Hang")
    await _ping(raw)
    conn = next(iter(srv.connections))
    walked = conn.h2.streams = _Walked(conn.h2.streams)
    last = 70000
    raw.write(_settings(*[(SettingsFrame.INITIAL_WINDOW_SIZE, 1000 + i) for i in range(2729)],
                        (SettingsFrame.INITIAL_WINDOW_SIZE, last)))
    await _ping(raw, b"settings")
    assert walked.walks == 1
    assert sorted(s.send_window for s in conn.h2.streams.values()) == [last] * 3  # nothing sent on them
    p.release.set()
    for sid in (1, 3, 5):
        assert (await raw.trailers(sid))["grpc-status"] == "0"


async def test_a_window_past_the_maximum_within_a_settings_frame_still_ends_the_connection(
        probe: tuple[GrpcH2Server, Probe]) -> None:
    """A stream widened by 1, then a SETTINGS frame whose first INITIAL_WINDOW_SIZE puts it
    past 2^31-1 and whose last brings it back: still FLOW_CONTROL_ERROR (6.9.2)."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.call(1, path="/t.T/Hang")
    raw.send(WindowUpdateFrame(1, window_increment=1))
    raw.write(_settings((SettingsFrame.INITIAL_WINDOW_SIZE, (1 << 31) - 1), (SettingsFrame.INITIAL_WINDOW_SIZE, 65535)))
    await _ends_with(raw, ErrorCodes.FLOW_CONTROL_ERROR)
    await answers(srv.port)


@pytest.mark.parametrize("kind", ["rst_stream", "window_update"])
async def test_frames_on_an_even_stream_id_end_the_connection(probe: tuple[GrpcH2Server, Probe], kind: str) -> None:
    """Even ids are the server's, and it opens none: stream 2 is idle even below the client's
    highest id, and RST_STREAM or WINDOW_UPDATE on an idle stream is PROTOCOL_ERROR (5.1)
    (they were ignored)."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.call(3, path="/t.T/Hang")
    raw.write(_frame(3 if kind == "rst_stream" else 8, 0, 2, b"\x00\x00\x00\x08"))
    await _ends_with(raw, ErrorCodes.PROTOCOL_ERROR)
    await answers(srv.port)


@pytest.mark.parametrize("sid", [1, 7])
async def test_a_priority_frame_on_which_its_stream_depends_ends_the_connection(
        probe: tuple[GrpcH2Server, Probe], sid: int) -> None:
    """A stream cannot depend on itself (RFC 9113 5.3.1: PROTOCOL_ERROR), on an open stream or
    an idle one: as on HEADERS, the connection ends (5.4.1) (a PRIORITY frame saying so was
    ignored). A PRIORITY frame on another stream, idle or not, is still ignored."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.call(1, path="/t.T/Hang")
    raw.write(_frame(2, 0, 3, (sid).to_bytes(4, "big") + b"\x10") + _frame(2, 0, 1, b"\x00\x00\x00\x05\x10"))
    await _ping(raw)
    raw.write(_frame(2, 0, sid, (sid | 1 << 31).to_bytes(4, "big") + b"\x10"))  # exclusive bit set
    await _ends_with(raw, ErrorCodes.PROTOCOL_ERROR)
    await answers(srv.port)


@pytest.mark.parametrize("trigger", ["window_update_0", "data_after_end", "window_past_max"])
async def test_stream_errors_the_peer_provokes_draw_from_the_reset_budget(
        probe: tuple[GrpcH2Server, Probe], trigger: str) -> None:
    """MadeYouReset (CVE-2025-8671): rapid reset with the server's own RST_STREAM. Each stream
    is opened, its handler started, then made to fail a stream rule (a WINDOW_UPDATE of 0, DATA
    after END_STREAM, a window past 2^31-1): the stream error cancels the handler as the peer's
    RST_STREAM does, and frees its place among the concurrent streams, so it draws from the same
    budget (it drew from none, or from the control budget that each call refills)."""
    srv, p = probe
    raw = await Raw.open(srv.port)
    frames: list[bytes] = []
    for i in range(1000):
        sid = 2 * i + 1
        frames += [HeadersFrame(sid, raw.block("/t.T/Hang"), flags=["END_HEADERS"]).serialize(),
                   DataFrame(sid, b"\x00\x00\x00\x00\x00", flags=["END_STREAM"]).serialize()]
        if trigger == "window_update_0":
            frames.append(_frame(8, 0, sid, b"\x00\x00\x00\x00"))
        elif trigger == "data_after_end":
            frames.append(_frame(0, 0, sid, b"x"))
        else:
            frames.append(_frame(8, 0, sid, ((1 << 31) - 1).to_bytes(4, "big")))
    raw.write(b"".join(frames))
    assert (await raw.goaway()).error_code == ErrorCodes.ENHANCE_YOUR_CALM
    await raw.ended()
    assert srv.rejected.get("rapid_reset", 0) + srv.rejected.get("control_flood", 0) == 1
    await answers(srv.port)
    assert p.hanging == 0


async def _drain(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


@pytest.mark.parametrize("message", ["too_large", "compressed"])
async def test_request_streams_ended_for_their_message_draw_from_the_reset_budget(message: str) -> None:
    """A request stream's handler starts with its headers; a message announced past the bound
    (RESOURCE_EXHAUSTED) or compressed (INTERNAL) ends the call and cancels the handler at once:
    1,000 such streams in a row are rapid reset too (they were drawn from no budget)."""
    srv = GrpcH2Server(LIMITS)
    same = lambda b: b  # noqa: E731 - bytes in, bytes out
    srv.add_registered_method_handlers("t.T", {"Drain": grpc.stream_stream_rpc_method_handler(
        _drain, request_deserializer=same, response_serializer=same)})
    await srv.start("127.0.0.1:0")
    try:
        raw = await Raw.open(srv.port)
        prefix = (b"\x00" + (LIMITS.max_message_bytes + 1).to_bytes(4, "big") if message == "too_large"
                  else b"\x01\x00\x00\x00\x01x")
        raw.write(b"".join(HeadersFrame(2 * i + 1, raw.block("/t.T/Drain"), flags=["END_HEADERS"]).serialize()
                           + _frame(0, 0, 2 * i + 1, prefix) for i in range(1000)))
        assert (await raw.goaway()).error_code == ErrorCodes.ENHANCE_YOUR_CALM
        await raw.ended()
        assert srv.rejected.get("rapid_reset", 0) == 1
    finally:
        await srv.stop(0)


async def test_a_header_block_on_a_reset_stream_is_still_decoded(probe: tuple[GrpcH2Server, Probe]) -> None:
    """Trailers on a stream the server reset (a malformed request) are dropped, but their block
    is decoded: the field it indexes is in the next request's table (RFC 7541 2.2; skipping it
    would shift every dynamic index after it)."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.send(HeadersFrame(1, raw.block(extra=[("X-Bad", "1")]), flags=["END_HEADERS"]))
    reset = await raw.until(lambda f: isinstance(f, RstStreamFrame))
    assert reset.stream_id == 1 and reset.error_code == ErrorCodes.PROTOCOL_ERROR  # type: ignore[attr-defined]
    raw.send(HeadersFrame(1, raw.encoder.encode([("x-sync", "one"), ("x-pad", "p" * 40)]),
                          flags=["END_HEADERS", "END_STREAM"]))
    block = raw.block(extra=[("x-pad", "p" * 40), ("x-sync", "one")])
    assert len(block) < 20  # both fields indexed from the trailers' block
    raw.send(HeadersFrame(3, block, flags=["END_HEADERS"]),
             DataFrame(3, b"\x00\x00\x00\x00\x02hi", flags=["END_STREAM"]))
    assert (await raw.trailers(3))["grpc-status"] == "0"


async def test_padding_is_credited_back_to_the_windows(probe: tuple[GrpcH2Server, Probe]) -> None:
    """Padded DATA counts whole against the windows (pad length byte and padding, RFC 9113
    6.9.1) and comes back whole once the call read its message: the connection's window and
    what is owed to it add up to the full window again."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    body = b"\x00\x00\x00\x00\x02hi"
    raw.send(HeadersFrame(1, raw.block(), flags=["END_HEADERS"]))
    raw.write(_frame(0, 0x8, 1, bytes((200,)) + body + b"\x00" * 200)
              + _frame(0, 0x8 | 0x1, 1, b"\xff" + b"\x00" * 255))
    assert (await raw.trailers(1))["grpc-status"] == "0"
    await _ping(raw)
    conn = next(iter(srv.connections))
    window, processed = conn.h2.inbound_window
    # 208 + 256 bytes taken and acknowledged (under half the window: not yet given back)
    assert (window, processed) == (srv.limits.connection_window - 464, 464)


@pytest.mark.parametrize(("length", "served"), [("7", True), ("8", False), ("6", False), ("0", False),
                                                ("-7", False), ("7x", False), ("", False)])
async def test_a_content_length_the_data_does_not_add_up_to_is_malformed(
        probe: tuple[GrpcH2Server, Probe], length: str, served: bool) -> None:
    """RFC 9113 8.1.1: a request whose DATA payloads do not add up to its content-length (more,
    fewer, or a value that is not a length) is malformed: RST_STREAM PROTOCOL_ERROR for the
    stream (h2 checked it; the connection by hand did not), the connection serving on. One
    that matches is served (padding is not content)."""
    srv, _ = probe
    raw = await Raw.open(srv.port)
    raw.send(HeadersFrame(1, raw.block(extra=[("content-length", length)]), flags=["END_HEADERS"]))
    body = b"\x00\x00\x00\x00\x02hi"
    raw.write(_frame(0, 0x8, 1, b"\x03" + body[:4] + b"\x00" * 3) + _frame(0, 0x1, 1, body[4:]))
    if served:
        assert (await raw.trailers(1))["grpc-status"] == "0"
    else:
        reset = await raw.until(lambda f: isinstance(f, RstStreamFrame))
        assert reset.stream_id == 1 and reset.error_code == ErrorCodes.PROTOCOL_ERROR  # type: ignore[attr-defined]
        assert srv.rejected["malformed_request"] == 1
    raw.call(3)
    assert (await raw.trailers(3))["grpc-status"] == "0"


async def _data_frames(raw: Raw, sid: int, want: int) -> list[int]:
    """The lengths of the DATA frames on ``sid`` until ``want`` bytes came (no more may)."""
    sizes: list[int] = []
    while sum(sizes) < want:
        frame = await raw.until(lambda f: isinstance(f, DataFrame) and f.stream_id == sid)
        sizes.append(len(frame.data))  # type: ignore[attr-defined]
    return sizes


async def test_a_window_made_negative_by_settings_holds_the_answer_until_it_is_positive(
        probe: tuple[GrpcH2Server, Probe]) -> None:
    """RFC 9113 6.9.2 (h2spec's "window size to be negative"): a stream window of 3 taken
    whole, SETTINGS_INITIAL_WINDOW_SIZE lowered to 2 leaves it at -1, a WINDOW_UPDATE of 2
    lets exactly 1 byte out; the rest waits for the window, each frame within the peer's
    frame size, no byte past what the windows granted."""
    srv, _ = probe
    raw = await Raw.open(srv.port, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 3})
    raw.call(1, b"40000", path="/t.T/Big")  # 40,005 bytes answered
    assert await _data_frames(raw, 1, 3) == [3]
    raw.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 2}))
    await _ping(raw)
    conn = next(iter(srv.connections))
    assert conn.h2.streams[1].send_window == -1
    raw.send(WindowUpdateFrame(1, window_increment=2))
    assert await _data_frames(raw, 1, 1) == [1]
    await _ping(raw, b"no-more!")
    assert sum(len(f.data) for f in raw.frames if isinstance(f, DataFrame) and f.stream_id == 1) == 4
    raw.send(WindowUpdateFrame(1, window_increment=40001))  # the connection window (65535) is wide enough
    sizes = await _data_frames(raw, 1, 40001)
    assert sum(sizes) == 40001 and max(sizes) <= 16384
    assert (await raw.trailers(1))["grpc-status"] == "0"


async def test_a_connection_read_a_byte_at_a_time_is_served(probe: tuple[GrpcH2Server, Probe]) -> None:
    """The preface, SETTINGS, a request's HEADERS and DATA, each split at every byte (reads that
    end inside the preface, a frame header, a payload): kept in pieces and joined once each
    frame is whole, the frames read as if whole."""
    srv, _ = probe
    raw = await Raw.open(srv.port, preface=False)
    body = b"\x00\x00\x00\x00\x05bytes"
    data = (PREFACE + SettingsFrame(0).serialize() + HeadersFrame(1, raw.block(), flags=["END_HEADERS"]).serialize()
            + DataFrame(1, body, flags=["END_STREAM"]).serialize())
    for i in range(len(data)):
        raw.write(data[i:i + 1])
        await raw.writer.drain()
        await asyncio.sleep(0)
    assert (await raw.trailers(1))["grpc-status"] == "0"
    assert any(isinstance(f, DataFrame) and f.data == body for f in raw.frames)
    conn = next(iter(srv.connections))
    assert conn.h2.unparsed == 0


async def test_a_smaller_header_table_binds_the_peer_once_it_acknowledged_our_settings() -> None:
    """SETTINGS_HEADER_TABLE_SIZE of 256: a request the client encoded before it read our
    SETTINGS uses the protocol's 4,096 and is served (RFC 9113 6.5.3; it was COMPRESSION_ERROR:
    the decoder held the peer to 256 from the first byte); once it acknowledged them, a block
    that does not shrink its table to 256 is COMPRESSION_ERROR, one that does is served."""
    srv = await _serve(replace(LIMITS, header_table_size=256))
    try:
        raw = await Raw.open(srv.port)
        raw.call(1, extra=[("x-long", "v" * 300)])  # at once: our SETTINGS not read yet
        assert (await raw.trailers(1))["grpc-status"] == "0"
        raw.send(SettingsFrame(0, flags=["ACK"]))
        raw.call(3)  # the encoder still at 4,096: no size update
        await _ends_with(raw, ErrorCodes.COMPRESSION_ERROR)

        raw = await Raw.open(srv.port)
        await raw.until(lambda f: isinstance(f, SettingsFrame) and "ACK" not in f.flags)
        raw.send(SettingsFrame(0, flags=["ACK"]))
        raw.encoder.header_table_size = 256  # the next block starts with a size update
        raw.call(1, extra=[("x-long", "v" * 100)])
        assert (await raw.trailers(1))["grpc-status"] == "0"
        raw.call(3, extra=[("x-long", "v" * 100)])
        assert (await raw.trailers(3))["grpc-status"] == "0"
        raw.close()
    finally:
        await srv.stop(0)


@pytest.mark.parametrize("window", [0, 65534, 1 << 31])
def test_a_stream_window_below_the_protocol_s_initial_is_refused(window: int) -> None:
    """A client may send 65,535 bytes on a stream before it reads our SETTINGS (RFC 9113
    6.9.2): a smaller stream window would fail its first request with FLOW_CONTROL_ERROR, so
    the bound refuses it at once (H2Conn took 0..2^31-1 at each connection)."""
    with pytest.raises(ValueError, match="stream_window"):
        H2Limits(stream_window=window)
    H2Limits(stream_window=65535)
