"""Fair service on the HTTP authorization port (extauthz/server/http.py), on a real server
process on the embedded store, where a check never suspends: connections that pipeline
requests without reading the answers must not starve the others, and what the server holds
for them stays bounded (their reading paused, their write buffers capped)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.server.http import FEED_BYTES, TURN_ANSWERS, HttpLimits

pytestmark = pytest.mark.slow

POLICY = ("version: 1\nidentity: [{header: x-api-key}]\n"
          "limiters:\n  - {name: r, type: request_rate, rate: 1000000, burst: 1000000}\n")
#: connections that pipeline and never read
HOSTILE = 20
#: the smallest requests, so that one read of the server (256 KiB) holds thousands
PIPELINED = b"GET / HTTP/1.1\r\nx-api-key: h\r\n\r\n" * 512
#: the most an answer takes here (a 200 with its RateLimit headers is about 200 bytes)
ANSWER_BYTES = 1024
#: the most one read of asyncio's socket transport returns
READ_BYTES = 256 * 1024

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Hostile:
    """Connections that keep sending pipelined requests and never read an answer (a small
    receive buffer, so the answers back up at once)."""

    def __init__(self, port: int, n: int) -> None:
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.setblocking(False)
            self.socks.append(s)
        self.sent = [0] * n
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        while not self.stop.is_set():
            progress = False
            for i, s in enumerate(self.socks):
                try:
                    self.sent[i] += s.send(PIPELINED)
                    progress = True
                except (BlockingIOError, OSError):
                    pass
            if not progress:
                self.stop.wait(0.01)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()


def normal_request(port: int, timeout: float) -> float:
    """Seconds for one request on a new connection (``timeout``: socket.timeout raised)."""
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(b"GET /v1/x HTTP/1.1\r\nhost: api\r\nx-api-key: normal\r\nconnection: close\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 200 ")
    return time.monotonic() - began


def http_status(server: ServerProcess) -> dict[str, Any]:
    with _OPENER.open(f"http://127.0.0.1:{server.admin_port}/status", timeout=30) as r:
        return json.load(r)["http"]  # type: ignore[no-any-return]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, int]]:
    (tmp_path / "api.yaml").write_text(POLICY)
    port = free_port()
    with ServerProcess([tmp_path], args=["--http-listen", f"127.0.0.1:{port}"]) as srv:
        yield srv, port


def test_connections_that_pipeline_without_reading_do_not_starve_the_others(
        server: tuple[ServerProcess, int]) -> None:
    srv, port = server
    quiet = max(normal_request(port, 30) for _ in range(5))
    # far above a loop turn here (5 s: a shared, slow machine), below what one read of every
    # hostile connection cost when each was answered to its end in one turn (over 10 s, or
    # the client's timeout: 20 x thousands of checks)
    bound = max(5.0, 50 * quiet)
    hostile = Hostile(port, HOSTILE)
    try:
        deadline = time.monotonic() + 30
        while min(hostile.sent) < 2 * READ_BYTES:  # every connection has given the server a full read
            assert time.monotonic() < deadline, f"the hostile clients could not send: {hostile.sent}"
            time.sleep(0.01)
        for _ in range(3):
            assert normal_request(port, bound) < bound
        # structural: every one of them got its answers paused (and its reading with them); one
        # paused past the header timeout (10 s) is aborted (not_reading), which a slow machine
        # may reach before the last is paused
        deadline = time.monotonic() + 60
        while True:
            status = http_status(srv)
            aborted = status["rejected"].get("not_reading", 0)
            if status["answers_paused"] + aborted >= HOSTILE:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["paused_reading"] == status["answers_paused"] == HOSTILE - aborted, status
        limits = HttpLimits()
        assert limits.max_write_buffer <= status["max_write_buffer_bytes"], status
        assert status["max_write_buffer_bytes"] <= limits.max_write_buffer + TURN_ANSWERS * ANSWER_BYTES, status
        # the queue: max_pipelined, overshot by at most one piece of the smallest requests
        assert status["max_queued_requests"] <= limits.max_pipelined + FEED_BYTES // 16, status
        assert status["max_unparsed_bytes"] <= READ_BYTES, status
        assert normal_request(port, bound) < bound
    finally:
        hostile.close()
