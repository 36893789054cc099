"""Bidirectional streams on the event-loop gRPC server (the rate limit quota stream's shape),
with grpcio's client: answers interleave with requests, the client's end ends the call OK, and a
graceful stop ends a stream the client keeps open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from extauthz.server.grpc_h2 import GrpcH2Server

WAIT = 10.0


async def _upper(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message.upper()


@pytest.fixture
async def server() -> AsyncIterator[GrpcH2Server]:
    srv = GrpcH2Server()
    same = lambda b: b  # noqa: E731 - bytes in, bytes out
    srv.add_registered_method_handlers("t.T", {"Upper": grpc.stream_stream_rpc_method_handler(
        _upper, request_deserializer=same, response_serializer=same)})
    await srv.start("127.0.0.1:0")
    yield srv
    await srv.stop(0)


def _call(channel: grpc.aio.Channel) -> Any:
    same = lambda b: b  # noqa: E731
    return channel.stream_stream("/t.T/Upper", request_serializer=same, response_deserializer=same)()


async def test_answers_interleave_and_the_clients_end_ends_the_call(server: GrpcH2Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = _call(ch)
        for word in (b"one", b"two", b"three"):
            await call.write(word)
            # the answer comes before the next request is sent: a stream, not a batch
            assert await asyncio.wait_for(call.read(), WAIT) == word.upper()
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), WAIT) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_a_graceful_stop_ends_an_open_stream(server: GrpcH2Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = _call(ch)
        await call.write(b"x")
        assert await asyncio.wait_for(call.read(), WAIT) == b"X"
        await asyncio.wait_for(server.stop(1.0), WAIT)
        assert await asyncio.wait_for(call.code(), WAIT) in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
