"""The gRPC port on the event loop attacked as a hostile client would, after it became serve's
default (issue 31's review): the per-call control allowance, the active-call bound shared by
every connection, a graceful stop against a client that never closes, what idle connections
and health Watch streams hold, an honest connection that is never idle between frames.

Raw frames (hyperframe, hpack) and the helpers of test_grpc_h2_server.py, on a server with
short timeouts and small bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
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

from extauthz.server.grpc_h2 import GrpcH2Server, H2Limits

from .test_grpc_h2_server import LIMITS, OPEN, WAIT, Probe, Raw, answers, gone


async def _serve(limits: H2Limits = LIMITS) -> tuple[GrpcH2Server, Probe]:
    srv = GrpcH2Server(limits)
    p = Probe()
    same = lambda b: b  # noqa: E731 - bytes in, bytes out
    srv.add_registered_method_handlers("t.T", {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=same, response_serializer=same)
        for name, fn in (("Echo", p.echo), ("Hang", p.hang), ("Big", p.big))})
    await srv.start("127.0.0.1:0")
    return srv, p


async def _close(srv: GrpcH2Server, p: Probe) -> None:
    p.release.set()
    await srv.stop(0)
    for raw in OPEN:
        raw.close()
        try:
            await raw.writer.wait_closed()
        except OSError:
            pass
    OPEN.clear()


@pytest.fixture
async def h2() -> AsyncIterator[tuple[GrpcH2Server, Probe]]:
    srv, p = await _serve()
    yield srv, p
    await _close(srv, p)


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
    for i, sid in enumerate(sids):
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
        for raw in OPEN:
            raw.close()
        OPEN.clear()
