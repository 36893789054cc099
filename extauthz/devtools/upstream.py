"""A tiny threaded HTTP/1.1 upstream for demos, e2e tests and benchmarks.

Every method gets ``200`` and a JSON echo::

    {"method": "GET", "path": "/v1/x?delay=0.1", "tier": "critical" | null, "headers": {...}}

``tier`` is the ``x-extauthz-tier`` header the ext_authz server adds to allowed requests;
``headers`` holds the request headers worth looking at in tests (see :data:`ECHOED_HEADERS`).
A ``delay=SECONDS`` query parameter sleeps before answering, to hold requests in flight.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from ..engine.answers import TIER_HEADER
from ..envoy.headers import FAILURE_MODE_HEADER

__all__ = ["ECHOED_HEADERS", "TIER_HEADER", "Upstream", "start_upstream"]

#: a request header naming the request, for :attr:`Upstream.held` (``demo --pictures``)
SEQ_HEADER = "x-demo-seq"
HELD_MAX = 200_000
ECHOED_HEADERS = frozenset(
    {
        "host",
        "x-request-id",
        "traceparent",
        "tracestate",
        FAILURE_MODE_HEADER,
        "x-forwarded-proto",
    }
)
_ECHOED_PREFIXES = ("x-extauthz-",)


class Upstream:
    """A running upstream. Counters are thread-safe; read them as attributes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._served = 0
        self._max_inflight = 0
        #: ``x-demo-seq`` request header -> (monotonic time the handler began, time it answered):
        #: what ``demo --pictures`` counts as in flight. Only requests carrying the header, at
        #: most HELD_MAX of them (bounded).
        self.held: dict[str, tuple[float, float]] = {}
        #: the ``x-demo-seq`` of held requests that carried Envoy's fail-open header
        #: (``x-envoy-auth-failure-mode-allowed``: they passed without a decision)
        self.unchecked: set[str] = set()
        self._server = _Server((host, port), _Handler, self)
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"upstream-{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def inflight(self) -> int:
        """Requests being handled right now."""
        with self._lock:
            return self._inflight

    @property
    def served(self) -> int:
        """Responses sent since start (or the last :meth:`reset`)."""
        with self._lock:
            return self._served

    @property
    def max_inflight(self) -> int:
        """Highest :attr:`inflight` seen since start (or the last :meth:`reset`)."""
        with self._lock:
            return self._max_inflight

    def reset(self) -> None:
        """Zero ``served``; restart ``max_inflight`` from the current ``inflight``."""
        with self._lock:
            self._served = 0
            self._max_inflight = self._inflight

    def _enter(self) -> None:
        with self._lock:
            self._inflight += 1
            self._max_inflight = max(self._max_inflight, self._inflight)

    def _leave(self, served: bool) -> None:
        with self._lock:
            self._inflight -= 1
            if served:
                self._served += 1

    def stop(self) -> None:
        """Stop accepting, close kept-alive connections and release the port."""
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_upstream(host: str = "127.0.0.1", port: int = 0) -> Upstream:
    """Start an upstream in background threads; port 0 picks a free port (see ``.port``)."""
    return Upstream(host, port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default (5) drops connections under benchmark load

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], upstream: Upstream
    ) -> None:
        self.upstream = upstream
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle on, the body waits ~40 ms for the
    # client's delayed ACK on every keep-alive request.
    disable_nagle_algorithm = True
    server: _Server

    def _handle(self) -> None:
        upstream = self.server.upstream
        upstream._enter()
        began = time.monotonic()
        served = False
        try:
            self._drain_body()
            delay = self._delay()
            if delay is None:
                self._reply(
                    400, {"error": "delay must be a non-negative number of seconds"}
                )
            else:
                if delay > 0:
                    time.sleep(delay)
                self._reply(200, self._echo())
            served = True
        finally:
            seq = self.headers.get(SEQ_HEADER)
            if seq is not None and len(upstream.held) < HELD_MAX:
                upstream.held[seq] = (began, time.monotonic())
                if self.headers.get(FAILURE_MODE_HEADER) is not None:
                    upstream.unchecked.add(seq)
            upstream._leave(served)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

    def _echo(self) -> dict[str, Any]:
        headers = {
            name.lower(): value
            for name, value in self.headers.items()
            if name.lower() in ECHOED_HEADERS
            or name.lower().startswith(_ECHOED_PREFIXES)
        }
        return {
            "method": self.command,
            "path": self.path,
            "tier": self.headers.get(TIER_HEADER),
            "headers": headers,
        }

    def _delay(self) -> float | None:
        values = parse_qs(urlsplit(self.path).query).get("delay")
        if not values:
            return 0.0
        try:
            delay = float(values[0])
        except ValueError:
            return None
        return delay if delay >= 0 else None

    def _drain_body(self) -> None:
        """Read the request body so the kept-alive connection stays in sync."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                self.rfile.read(size + 2)  # chunk data + CRLF
        length = int(self.headers.get("Content-Length") or 0)
        if length > 0:
            self.rfile.read(length)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client (or Envoy) went away: fine here

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr line."""
