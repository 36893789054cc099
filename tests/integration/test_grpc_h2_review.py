"""The gRPC port on the event loop attacked as a hostile client would, after it became serve's
default (issue 31's review): the per-call control allowance, the active-call bound shared by
every connection, a graceful stop against a client that never closes, what idle connections
and health Watch streams hold, an honest connection that is never idle between frames.

Raw frames (hyperframe, hpack) and the helpers of test_grpc_h2_server.py, on a server with
short timeouts and small bounds.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from extauthz.core.settings import CHECK_BUDGET_MS, ENVOY_MARGIN_MS
from extauthz.proto import auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.grpc_h2 import GrpcH2Server, H2Limits, Slots
from testinfra.redis_servers import RedisSingle

from .test_grpc_h2_server import LIMITS, PREFACE, WAIT, Probe, Raw, answers, close_open, gone, stop_and_close
from .test_server import check_request


async def _serve(limits: H2Limits = LIMITS) -> tuple[GrpcH2Server, Probe]:
    srv = GrpcH2Server(limits)
    p = Probe()
    same = lambda b: b  # noqa: E731 - bytes in, bytes out
    srv.add_registered_method_handlers("t.T", {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=same, response_serializer=same)
        for name, fn in (("Echo", p.echo), ("Hang", p.hang), ("Big", p.big))})
    await srv.start("127.0.0.1:0")
    return srv, p


@pytest.fixture
async def h2() -> AsyncIterator[tuple[GrpcH2Server, Probe]]:
    srv, p = await _serve()
    yield srv, p
    await stop_and_close(srv, p)


def _echo(raw: Raw, sid: int, body: bytes = b"hi") -> bytes:
    return b"".join(f.serialize() for f in (
        HeadersFrame(sid, raw.block(), flags=["END_HEADERS"]),
        DataFrame(sid, len(body).to_bytes(5, "big") + body, flags=["END_STREAM"])))


async def test_a_busy_connection_whose_reads_end_inside_a_frame_is_not_slow(
        h2: tuple[GrpcH2Server, Probe]) -> None:
    """The slow-frame bound is on one frame (or header block) from its first byte: a busy
    honest connection whose every read ends inside a frame (Envoy's many calls read 256 KiB at
    a time while the loop is busy) completes frames all along and must not be cut off as a
    trickle. Before: the bound ran from the first read that ended inside a frame until one
    ended on a frame boundary, so such a connection got GOAWAY ENHANCE_YOUR_CALM after
    request_timeout."""
    srv, _ = h2
    raw = await Raw.open(srv.port)
    sids = [2 * i + 1 for i in range(int(3 * LIMITS.request_timeout / 0.05))]  # ~3 request_timeouts
    calls = [_echo(raw, sid) for sid in sids]
    stream = b"".join(calls)
    bounds = [0]
    for call in calls:  # each read: the rest of one call's frames and the first byte of the next's
        bounds.append(bounds[-1] + len(call))
    answered = 0
    for i in range(len(sids)):
        raw.write(stream[(bounds[i] + 1 if i else 0):bounds[i + 1] + 1])
        await asyncio.sleep(0.05)
        assert not srv.rejected.get("slow_frame"), f"cut off after {i} calls, each answered"
        if i >= 2:
            assert (await raw.trailers(sids[i - 2]))["grpc-status"] == "0"
            answered += 1
    assert answered == len(sids) - 2 and srv.rejected == {}


async def test_a_header_block_trickled_frame_by_frame_is_still_cut_off(h2: tuple[GrpcH2Server, Probe]) -> None:
    """The other side of the bound above: a header block whose CONTINUATION frames each
    complete but which never ends is closed within request_timeout of its HEADERS frame,
    frames completing or not."""
    srv, _ = h2
    raw = await Raw.open(srv.port)
    block = raw.block(extra=[("x-pad", "p" * 400)])
    raw.send(HeadersFrame(1, block[:1]))
    for i in range(1, len(block)):  # one CONTINUATION of one byte each 50 ms
        if srv.rejected.get("slow_frame"):
            break
        raw.send(ContinuationFrame(1, block[i:i + 1]))
        await asyncio.sleep(0.05)
    assert srv.rejected.get("slow_frame") == 1
    await raw.ended()
    await answers(srv.port)


async def _sink_server(limits: H2Limits) -> GrpcH2Server:
    async def sink(requests: Any, context: Any) -> bytes:
        async for _ in requests:
            pass
        return b"ok"

    same = lambda b: b  # noqa: E731 - bytes in, bytes out
    srv = GrpcH2Server(limits)
    srv.add_registered_method_handlers("t.T", {"Sink": grpc.stream_unary_rpc_method_handler(
        sink, request_deserializer=same, response_serializer=same)})
    await srv.start("127.0.0.1:0")
    return srv


async def test_a_client_that_never_closes_holds_a_stop_no_longer_than_close_linger() -> None:
    """A graceful stop answers a client stream the client keeps open, waits for the client to
    close its side, then shuts the connection and waits for the peer to go: a client that does
    neither (no RST_STREAM, no FIN, it reads nothing) held the stop for close_linger twice past
    the stream's end. Now close_linger bounds the two waits together (a timeline bound of the
    code, with a generous allowance for a slow machine; never a measured speed)."""
    linger = 2.0
    srv = await _sink_server(replace(LIMITS, close_linger=linger))
    try:
        client = await Raw.open(srv.port)
        client.call(1, body=b"entry", path="/t.T/Sink", end=False)  # the stream stays open
        for _ in range(int(WAIT / 0.01)):
            if any(c.calls for c in srv.connections):
                break
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(srv.stop(0), WAIT)
        took = loop.time() - start
        assert not srv.connections and srv.half_open == 0
        assert took < 1.75 * linger, f"the stop took {took:.2f} s (close_linger {linger} s)"
    finally:
        await srv.stop(0)
        await close_open(wait=False)


@pytest.mark.parametrize("cheap", ["empty_call", "reset_call"])
async def test_the_per_call_allowance_buys_no_flood(h2: tuple[GrpcH2Server, Probe], cheap: str) -> None:
    """Each call started earns its connection 4 no-progress frames (grpcio's WINDOW_UPDATEs),
    so frames that make no progress are bounded by 4 per call: the cheapest calls (headers
    only, answered INTERNAL without a handler; or reset at once, CVE-2023-44487) each followed
    by 5 PINGs, WINDOW_UPDATEs and SETTINGS still overdraw the budget and are cut off; no handler
    is left running."""
    srv, p = h2
    raw = await Raw.open(srv.port)
    frames: list[Frame] = []
    noise: list[Frame] = [PingFrame(0, opaque_data=b"flooding"), WindowUpdateFrame(0, window_increment=1),
                          SettingsFrame(0, settings={}), PingFrame(0, opaque_data=b"flooding"),
                          WindowUpdateFrame(0, window_increment=1)]
    for i in range(1000):
        sid = 2 * i + 1
        if cheap == "empty_call":
            frames.append(HeadersFrame(sid, raw.block(), flags=["END_HEADERS", "END_STREAM"]))
        else:
            frames += [HeadersFrame(sid, raw.block("/t.T/Hang"), flags=["END_HEADERS"]),
                       DataFrame(sid, b"\x00\x00\x00\x00\x00", flags=["END_STREAM"]),
                       RstStreamFrame(sid, error_code=ErrorCodes.CANCEL)]
        frames += noise
    raw.send(*frames)
    assert (await raw.goaway()).error_code == ErrorCodes.ENHANCE_YOUR_CALM
    await raw.ended()
    assert srv.rejected.get("control_flood", 0) + srv.rejected.get("rapid_reset", 0) == 1
    assert srv.calls < 1000
    await gone(srv)
    assert p.hanging == 0
    await answers(srv.port)


async def test_grpcio_shaped_calls_within_the_allowance_are_served(h2: tuple[GrpcH2Server, Probe]) -> None:
    """The allowance's purpose: 1,000 calls one after another, each with the two small stream
    WINDOW_UPDATEs and a BDP PING grpcio's client sends, far past the control budget's burst,
    are all answered."""
    srv, _ = h2
    raw = await Raw.open(srv.port)
    for i in range(1000):
        sid = 2 * i + 1
        raw.write(_echo(raw, sid))
        raw.send(WindowUpdateFrame(sid, window_increment=5), WindowUpdateFrame(sid, window_increment=7),
                 PingFrame(0, opaque_data=b"bdpbdpbd"))
        assert (await raw.trailers(sid))["grpc-status"] == "0"
    assert srv.rejected == {}


async def test_a_call_that_waits_out_its_time_for_a_slot_is_decided_with_none_left(
        h2: tuple[GrpcH2Server, Probe]) -> None:
    """max_active_calls is shared by every connection: one client holding the slots with slow
    calls made another connection's call wait until its grpc-timeout passed, answered
    DEADLINE_EXCEEDED, counted nowhere (Envoy fails such a Check open, unseen). Now a call
    whose deadline nears without a slot runs without one, told it has no time left
    (time_remaining() 0: the Check flow then decides without the store, counted as
    ``overload``); a call with time enough still waits its turn."""
    srv, p = h2
    srv.active = Slots(2)  # (2 at once for this test)
    holder = await Raw.open(srv.port)
    holder.call(1, path="/t.T/Hang")
    holder.call(3, path="/t.T/Hang")
    for _ in range(int(WAIT / 0.01)):
        if p.hanging == 2:
            break
        await asyncio.sleep(0.01)
    other = await Raw.open(srv.port)
    other.call(1, extra=[("grpc-timeout", "300m")])
    trailers = await other.trailers(1)
    assert trailers["grpc-status"] == "0", trailers
    assert p.remaining == [0.0] and p.hanging == 2
    assert srv.rejected == {"no_slot_in_time": 1}
    other.call(3, extra=[("grpc-timeout", "30S")])  # time enough: it waits for a slot
    await asyncio.sleep(0.3)
    assert len(p.remaining) == 1
    p.release.set()
    assert (await other.trailers(3))["grpc-status"] == "0"
    assert len(p.remaining) == 2 and p.remaining[1] is not None and p.remaining[1] > 20


async def test_a_check_without_a_slot_in_time_fails_open_counted(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    """The real server on Redis, its slots all held (here: none free): Envoy's Check, its
    grpc-timeout the budget plus Envoy's margin as envoy-config renders it, is answered before
    that deadline, allowed by failure_mode open and counted in extauthz_fail_open_total
    {reason="overload"}, not left to Envoy's timeout (before: DEADLINE_EXCEEDED, counted nowhere)."""
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: user-rate, type: request_rate, rate: 100, burst: 100}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              redis_url=redis_single_clean.url))
    await srv.start()
    try:
        assert isinstance(srv.grpc, GrpcH2Server)
        srv.grpc.active = Slots(0)  # every slot held by other calls
        timeout = (CHECK_BUDGET_MS + ENVOY_MARGIN_MS) / 1000
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            answer = await auth_pb2_grpc.AuthorizationStub(ch).Check(check_request(), timeout=timeout)
        assert answer.HasField("ok_response")
        assert srv.engine.failures == {"overload": 1}
        assert srv.grpc.rejected == {"no_slot_in_time": 1}
    finally:
        await srv.stop(grace=0)


@pytest.mark.parametrize("shut", ["window", "socket"])
async def test_a_health_watch_that_is_not_read_blocks_no_status_change(tmp_path: Path, shut: str) -> None:
    """grpc_health's Watch writes each status while it holds the service's lock, which every
    status change (``set``, the graceful stop's NOT_SERVING) takes: a Watch whose write
    waited for a peer that never reads (its stream window 0; or its socket not read, the
    connection paused under the write buffer bound) held the lock, and the next status change,
    so the graceful stop, waited forever. A small server-stream message is queued (bounded per
    call) and the write returns; the stop completes."""
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters: []\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off"))
    await srv.start()
    try:
        assert isinstance(srv.grpc, GrpcH2Server)
        raw = await Raw.open(srv.port, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0} if shut == "window" else {})
        raw.call(1, body=b"", path="/grpc.health.v1.Health/Watch")
        conn = None
        for _ in range(int(WAIT / 0.01)):
            conn = next(iter(srv.grpc.connections), None)
            if conn is not None and conn.calls.get(1) is not None and conn.calls[1].task is not None:
                break
            await asyncio.sleep(0.01)
        assert conn is not None
        if shut == "socket":  # the client reads nothing: the connection's writing is paused
            conn.pause_writing()
        await asyncio.wait_for(srv.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING), WAIT)
        await asyncio.wait_for(srv.stop(grace=0.2), WAIT)
    finally:
        await close_open(wait=False)  # (first: a Watch still blocked is let go with its connection)
        await asyncio.sleep(0.1)
        await asyncio.wait_for(srv.stop(grace=0), WAIT)


def _held_by_connections(snapshot: tracemalloc.Snapshot) -> int:
    """The heap a connection's parts hold (its h2 state, HPACK tables, protocol, transport and
    socket), whatever other threads (grpcio's, of other tests) allocate meanwhile."""
    parts = ("*/h2/*", "*/hpack/*", "*/hpackd.py", "*/hyperframe/*", "*/asyncio/*", "*/grpc_h2.py", "*/socket.py",
             "*/selectors.py")
    return sum(t.size for t in snapshot.filter_traces([tracemalloc.Filter(True, p) for p in parts]).traces)


async def test_many_idle_connections_hold_a_bounded_amount_each() -> None:
    """Each idle connection (preface and SETTINGS done, no call) holds the h2 state and
    HPACK tables, measured here at ~18 KiB of Python heap with its client socket: bounded per
    connection (the bound below leaves room for another Python or h2), so max_connections
    bounds the whole; all are let go at the idle timeout."""
    n = 200
    srv, p = await _serve(replace(LIMITS, max_connections=n, idle_timeout=1.0))
    socks: list[socket.socket] = []
    try:
        gc.collect()
        tracemalloc.start()
        before = _held_by_connections(tracemalloc.take_snapshot())
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.setblocking(False)
            s.send(PREFACE + SettingsFrame(0).serialize())
            socks.append(s)
        for _ in range(int(WAIT / 0.01)):
            if len(srv.connections) == n and all(c.handshaken for c in srv.connections):
                break
            await asyncio.sleep(0.01)
        assert len(srv.connections) == n and all(c.handshaken for c in srv.connections)
        gc.collect()
        each = (_held_by_connections(tracemalloc.take_snapshot()) - before) / n
        tracemalloc.stop()
        assert each < 48 << 10, f"{each:.0f} bytes per idle connection"
        await gone(srv)  # the idle timeout frees them all
        assert srv.rejected.get("idle_timeout") == n
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        await stop_and_close(srv, p)


@pytest.mark.parametrize("attack", ["continuation_flood", "oversized_block", "bomb"])
async def test_header_bounds_hold_on_a_request_stream_s_trailers(attack: str) -> None:
    """The header bounds on a stream that is already running (the access log's, the quota
    stream's): its trailers, a CONTINUATION flood after them, an encoded block past the
    list bound, a block that decodes past it, all end the connection before decoding more;
    another connection is still served."""
    srv = await _sink_server(LIMITS)
    try:
        raw = await Raw.open(srv.port)
        raw.call(1, body=b"entry", path="/t.T/Sink", end=False)
        for _ in range(int(WAIT / 0.01)):
            if any(c.calls.get(1) and c.calls[1].task for c in srv.connections):
                break
            await asyncio.sleep(0.01)
        if attack == "continuation_flood":
            raw.send(HeadersFrame(1, raw.encoder.encode([("x-t", "1")])[:1], flags=["END_STREAM"]))
            raw.send(*[ContinuationFrame(1, b"\x40\x01a\x01b") for _ in range(5000)])
        elif attack == "oversized_block":
            chunk = b"\xff" * 8000
            raw.send(HeadersFrame(1, chunk, flags=["END_STREAM"]), ContinuationFrame(1, chunk),
                     ContinuationFrame(1, chunk, flags=["END_HEADERS"]))
        else:
            raw.send(HeadersFrame(1, raw.encoder.encode([("x-bomb", "b" * 4000)]), flags=["END_HEADERS", "END_STREAM"]))
            raw.send(HeadersFrame(3, raw.block("/t.T/Sink"), flags=["END_HEADERS"]))
            raw.send(HeadersFrame(3, raw.encoder.encode([("x-bomb", "b" * 4000)]) + b"\xbe" * 1000,
                                  flags=["END_HEADERS", "END_STREAM"]))
        away = await raw.goaway()
        assert away.error_code in (ErrorCodes.PROTOCOL_ERROR, ErrorCodes.ENHANCE_YOUR_CALM), away
        await raw.ended()
        await gone(srv)
        raw = await Raw.open(srv.port)
        raw.call(1, body=b"entry", path="/t.T/Sink")
        assert (await raw.trailers(1))["grpc-status"] == "0"
    finally:
        await srv.stop(0)
        await close_open(wait=False)


@pytest.mark.parametrize("level", ["connection", "stream"])
async def test_window_updates_that_cannot_move_an_answer_are_a_flood(
        h2: tuple[GrpcH2Server, Probe], level: str) -> None:
    """A WINDOW_UPDATE of 1 KiB or more passed the control budget while any answer waited:
    with answers held by their own shut stream windows, connection WINDOW_UPDATEs (each
    making the server retry every waiting answer) came free, a CPU flood with no progress;
    likewise stream WINDOW_UPDATEs on a stream whose window is already wide open while the
    connection's is shut. Only an update to a window that is what holds an answer back is
    free now; the rest draw from the budget and the flood is cut off."""
    srv, _ = h2
    if level == "connection":  # every stream window shut: the answers wait on them
        raw = await Raw.open(srv.port, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0})
    else:
        raw = await Raw.open(srv.port)
    for sid in (1, 3, 5):
        raw.call(sid, b"60000" if level == "connection" else b"70000", path="/t.T/Big")
    for _ in range(int(WAIT / 0.01)):
        conn = next(iter(srv.connections))
        if len(conn.calls) == 3 and all(c.out for c in conn.calls.values()):
            break
        await asyncio.sleep(0.01)
    if level == "connection":
        flood = WindowUpdateFrame(0, window_increment=1024)
    else:  # the connection window (65,535) is spent on stream 1; stream 3's own window is wide
        raw.send(WindowUpdateFrame(3, window_increment=1 << 20))
        flood = WindowUpdateFrame(3, window_increment=1024)
    raw.send(*[flood] * 5000)
    assert (await raw.goaway()).error_code == ErrorCodes.ENHANCE_YOUR_CALM
    await raw.ended()
    assert srv.rejected["control_flood"] == 1
    await gone(srv)
    await answers(srv.port)
