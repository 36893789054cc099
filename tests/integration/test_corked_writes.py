"""Corked writes (extauthz/core/cork.py), counted on real sockets: the answers to pipelined HTTP
requests decided in one loop turn leave in one ``transport.write``, and so do the Redis
commands of one turn on the lean connection; order and answers unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from extauthz.server.app import Server, ServerConfig
from tests.integration.test_http_server import POLICY, request, statuses
from tests.observe.helpers import eventually


def count_writes(transport: Any) -> list[bytes]:
    """Every ``transport.write`` from now on (the bytes, in order); the write still happens."""
    writes: list[bytes] = []
    real = transport.write

    def write(data: bytes) -> None:
        writes.append(bytes(data))
        real(data)

    transport.write = write
    return writes


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="off", http_listen="127.0.0.1:0",
                              admin_listen="off"))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


async def test_pipelined_answers_of_one_turn_leave_in_one_write(server: Server) -> None:
    assert server.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    conn = await eventually(lambda: next(iter(server.http.connections), None))
    writes = count_writes(conn.transport)
    burst = (request("/v1/charges", method="POST", key="sk_live_c1") + request(key="sk_test_c2")
             + request(key="sk_live_c3") + request(key="sk_live_c3", version="1.0"))
    writer.write(burst)  # one segment: the four requests arrive in one read
    async with asyncio.timeout(5):
        raw = await reader.read()  # to the close after the HTTP/1.0 request
    writer.close()
    assert statuses(raw) == [200, 200, 200, 200]
    tiers = [line.split(b": ")[1] for line in raw.split(b"\r\n") if line.startswith(b"x-extauthz-tier")]
    assert tiers == [b"critical", b"test", b"get", b"get"]  # in order
    assert len(writes) == 1  # was one write per answer
    assert writes[0] == raw


async def test_answers_of_later_turns_are_written_after_the_earlier_ones(server: Server) -> None:
    assert server.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    conn = await eventually(lambda: next(iter(server.http.connections), None))
    writes = count_writes(conn.transport)
    raw = b""
    for i in range(3):  # one request per round trip: nothing to join, one write each
        writer.write(request(key=f"sk_live_t{i}"))
        async with asyncio.timeout(5):
            while raw.count(b"HTTP/1.1 ") <= i:
                raw += await reader.read(65536)
    writer.close()
    assert statuses(raw) == [200, 200, 200]
    assert len(writes) == 3
    assert b"".join(writes) == raw
