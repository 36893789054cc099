"""The HTTP authorization port in-process: keep-alive, pipelining, bounds, malformed input,
and both ports of one server sharing one engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from extauthz.server.app import Server, ServerConfig
from extauthz.server.http import HttpLimits

#: identity, test mode and rules as in the quick start (test_http_parity.py adds its limiters)
POLICY_HEAD = """\
version: 1
identity: [{header: x-api-key}, {source_ip: true}]
test_mode: {key_prefix: sk_test_}
classification:
  rules:
    - {match: {methods: [POST], path_prefix: /v1/charges}, tier: critical}
limiters:
"""
POLICY = POLICY_HEAD + "  - {name: user-rate, type: request_rate, rate: 1, burst: 3}\n"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                              admin_listen="off", http_header_timeout=0.5))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


async def exchange(port: int, data: bytes, *, wait: float = 5.0) -> bytes:
    """Send ``data``; read until the server closes (or ``wait`` seconds: ``<timeout>``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        async with asyncio.timeout(wait):
            while chunk := await reader.read(65536):
                out += chunk
    except TimeoutError:
        out += b"<timeout>"
    writer.close()
    return out


def statuses(raw: bytes) -> list[int]:
    return [int(line.split()[1]) for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def request(path: str = "/v1/customers", key: str = "sk_live_a", method: str = "GET",
            extra: str = "", version: str = "1.1") -> bytes:
    return (f"{method} {path} HTTP/{version}\r\nhost: api\r\nx-api-key: {key}\r\n{extra}\r\n").encode()


async def test_keep_alive_and_pipelined_answers_in_order(server: Server) -> None:
    burst = (request("/v1/charges", method="POST", key="sk_live_p")
             + request("/v1/customers", key="sk_test_p")
             + request("/v1/customers", key="sk_live_q")
             + request("/v1/customers", key="sk_live_q", version="1.0"))
    raw = await exchange(server.http_port, burst)
    assert statuses(raw) == [200, 200, 200, 200]
    tiers = [line.split(b": ")[1] for line in raw.split(b"\r\n") if line.startswith(b"x-extauthz-tier")]
    assert tiers == [b"critical", b"test", b"get", b"get"]
    assert raw.endswith(b"\r\n\r\n")  # closed after the HTTP/1.0 request, nothing after it


async def test_a_body_is_skipped_and_the_next_request_still_parsed(server: Server) -> None:
    burst = (b"POST /v1/x HTTP/1.1\r\nhost: a\r\nx-api-key: sk_live_b\r\ncontent-length: 11\r\n\r\nhello world"
             + request(key="sk_live_b", extra="connection: close\r\n"))
    raw = await exchange(server.http_port, burst)
    assert statuses(raw) == [200, 200]
    assert b"ratelimit: \"user-rate\";r=1;" in raw  # the same user's second token


async def test_repeated_headers_are_joined_as_envoy_joins_them_for_grpc(server: Server) -> None:
    # Envoy's gRPC CheckRequest merges a repeated header into one value joined with ",": the
    # same client must be the same identity (the same bucket) on the HTTP port.
    repeated = request(key="sk_live_j1", extra="x-api-key: sk_live_j2\r\n")
    joined = request(key="sk_live_j1,sk_live_j2", extra="connection: close\r\n")
    raw = await exchange(server.http_port, repeated + joined)
    assert statuses(raw) == [200, 200]
    assert b"ratelimit: \"user-rate\";r=1;" in raw  # the second request took the same bucket's token


async def test_checks_decided_at_once_are_bounded(server: Server) -> None:
    """More connections than max_active_checks, each with a request: they all get answered,
    and no more checks than the bound are ever being decided at once (the rest wait before
    their check starts, so the store deadline never counts the wait)."""
    engine = server.engine
    decide = engine.decide
    active, most = 0, 0

    async def counted(ctx: Any, *args: Any) -> Any:
        nonlocal active, most
        active += 1
        most = max(most, active)
        try:
            await asyncio.sleep(0.01)  # a store call in flight
            return await decide(ctx, *args)
        finally:
            active -= 1

    engine.decide = counted  # type: ignore[method-assign]
    bound = HttpLimits().max_active_checks
    answers = await asyncio.gather(*(exchange(server.http_port, request(key=f"sk_live_cap{i}",
                                                                        extra="connection: close\r\n"))
                                     for i in range(3 * bound)))
    assert [statuses(a) for a in answers] == [[200]] * (3 * bound)
    assert most == bound


async def test_the_fourth_request_is_refused_with_problem_json(server: Server) -> None:
    last = request(key="sk_live_r", extra="connection: close\r\n")
    raw = await exchange(server.http_port, request(key="sk_live_r") * 3 + last)
    assert statuses(raw) == [200, 200, 200, 429]
    refused = raw.rsplit(b"HTTP/1.1 ", 1)[1]
    assert b"retry-after: 1\r\n" in refused
    assert b"content-type: application/problem+json" in refused
    assert b'"limiter":"user-rate"' in refused and b'"type":"urn:extauthz:problem:' in refused


@pytest.mark.parametrize(("data", "status"), [
    (b"NOT-HTTP\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nbad header line\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    (b"GET /" + b"p" * 20_000 + b" HTTP/1.1\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(150)) + b"\r\n", 431),
])
async def test_malformed_requests_get_a_4xx_and_a_closed_connection(server: Server, data: bytes, status: int) -> None:
    raw = await exchange(server.http_port, data)
    assert statuses(raw) == [status]
    assert b"connection: close" in raw and not raw.endswith(b"<timeout>")
    # and the server keeps serving
    assert statuses(await exchange(server.http_port, request(extra="connection: close\r\n"))) == [200]


async def test_an_upgrade_is_answered_then_closed(server: Server) -> None:
    raw = await exchange(server.http_port, b"GET / HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\n"
                         b"upgrade: websocket\r\n\r\n" + request())
    assert statuses(raw) == [200] and not raw.endswith(b"<timeout>")


async def test_answers_owed_come_before_the_error(server: Server) -> None:
    raw = await exchange(server.http_port, request(key="sk_live_o") + b"NOT-HTTP\r\n\r\n")
    assert statuses(raw) == [200, 400]


async def test_a_client_that_never_finishes_its_headers_is_cut_off(server: Server) -> None:
    raw = await exchange(server.http_port, b"GET / HTTP/1.1\r\nhost: a\r\n", wait=10.0)
    assert statuses(raw) == [408]
    assert not raw.endswith(b"<timeout>")
    assert server.http is not None and server.http.rejected.get("header_timeout") == 1
    assert server.panel.status()["http"]["rejected"] == {"header_timeout": 1}
    assert statuses(await exchange(server.http_port, request(extra="connection: close\r\n"))) == [200]


async def test_many_connections_each_served(server: Server) -> None:
    results = await asyncio.gather(*[
        exchange(server.http_port, request(key=f"sk_live_c{i}", extra="connection: close\r\n"))
        for i in range(50)])
    assert all(statuses(r) == [200] for r in results)


async def test_grpc_off_http_only(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="off", http_listen="127.0.0.1:0", admin_listen="off"))
    await srv.start()
    try:
        assert srv.port == 0 and srv.grpc is None
        assert statuses(await exchange(srv.http_port, request(extra="connection: close\r\n"))) == [200]
    finally:
        await srv.stop(grace=0)


def test_both_ports_off_is_refused(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    with pytest.raises(ValueError, match="nothing to serve"):
        Server(ServerConfig(policies=[str(policy)], listen="", http_listen=None, admin_listen="off"))


def test_limits_defaults_are_bounded() -> None:
    limits = HttpLimits()
    assert limits.max_header_bytes <= 64 * 1024 and limits.max_headers <= 200
    assert 0 < limits.header_timeout <= 60


async def test_a_bug_of_ours_answers_500_and_the_server_goes_on(server: Server,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(ctx: object, *args: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(server.engine, "decide", broken)
    raw = await exchange(server.http_port, request() + request())
    assert statuses(raw) == [500]  # Envoy fails open on a 5xx; the connection is closed
    monkeypatch.undo()
    assert statuses(await exchange(server.http_port, request(extra="connection: close\r\n"))) == [200]
    assert server.http is not None and server.http.rejected.get("internal") == 1


async def test_a_connection_that_never_speaks_is_cut_off(server: Server) -> None:
    raw = await exchange(server.http_port, b"", wait=5.0)
    assert statuses(raw) == [408] and not raw.endswith(b"<timeout>")
    assert server.http is not None and server.http.rejected.get("header_timeout") == 1


async def test_an_idle_connection_flood_is_bounded(server: Server) -> None:
    assert server.http is not None
    server.http.limits = dataclasses.replace(server.http.limits, max_connections=3, header_timeout=30.0)
    idle = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(3)]
    for _ in range(50):  # the three are accepted (the count is taken when the server sees them)
        if len(server.http.connections) == 3:
            break
        await asyncio.sleep(0.02)
    assert len(server.http.connections) == 3
    assert await exchange(server.http_port, request()) == b""  # closed at once, unanswered
    assert server.http.rejected.get("too_many_connections") == 1
    for _, writer in idle:
        writer.close()
    for _ in range(50):
        if not server.http.connections:
            break
        await asyncio.sleep(0.02)
    assert statuses(await exchange(server.http_port, request(extra="connection: close\r\n"))) == [200]


async def test_a_chunked_body_is_skipped_and_the_connection_stays_in_sync(server: Server) -> None:
    burst = (b"POST /v1/x HTTP/1.1\r\nhost: a\r\nx-api-key: sk_live_ch\r\ntransfer-encoding: chunked\r\n\r\n"
             b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
             + request(key="sk_live_ch", extra="connection: close\r\n"))
    raw = await exchange(server.http_port, burst)
    assert statuses(raw) == [200, 200] and not raw.endswith(b"<timeout>")
    assert b"ratelimit: \"user-rate\";r=1;" in raw  # both were read as the same user's requests


async def test_non_ascii_header_bytes_and_duplicate_headers_are_answered(server: Server) -> None:
    # obs-text in a header value is legal HTTP/1.1: read as latin-1; a repeated header is joined
    raw = await exchange(server.http_port,
                         b"GET /v1/x HTTP/1.1\r\nhost: a\r\nx-api-key: sk_live_\xff\xfe\r\n\r\n"
                         + request(key="sk_live_d1", extra="x-api-key: sk_live_d2\r\nconnection: close\r\n"))
    assert statuses(raw) == [200, 200] and not raw.endswith(b"<timeout>")
    assert server.http is not None and server.http.rejected == {}
    # raw non-ASCII in the request target is not (Envoy percent-encodes it): 400 and closed
    raw = await exchange(server.http_port, b"GET /v1/\xc3\xa9 HTTP/1.1\r\nhost: a\r\n\r\n")
    assert statuses(raw) == [400] and not raw.endswith(b"<timeout>")
    assert statuses(await exchange(server.http_port, request(extra="connection: close\r\n"))) == [200]


async def test_a_client_closing_mid_answer_leaves_the_server_serving(server: Server,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(5):
        _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(request(key="sk_live_gone") * 20)
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        writer.close()
    last = request(key="sk_live_next", extra="connection: close\r\n")
    assert statuses(await exchange(server.http_port, last)) == [200]
    assert server.http is not None
    for _ in range(50):
        if not server.http.connections:
            break
        await asyncio.sleep(0.02)
    assert not server.http.connections
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_after_a_protocol_error_nothing_more_is_read(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answers owed before a 400 are still sent; bytes arriving meanwhile are dropped,
    neither parsed (a second error) nor answered, and the answers arrive intact."""
    decide = server.engine.decide
    gate = asyncio.Event()
    calls = 0

    async def gated(ctx: Any, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            await gate.wait()
        return await decide(ctx, *args)

    monkeypatch.setattr(server.engine, "decide", gated)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(request(key="sk_live_e1") + request(key="sk_live_e2") + b"NOT-HTTP\r\n\r\n")
    await writer.drain()
    for _ in range(100):
        if calls == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the first answer written; the second decision waiting
    writer.write(b"MORE-GARBAGE\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)
    gate.set()
    async with asyncio.timeout(5):
        raw = await reader.read(-1)
    writer.close()
    assert statuses(raw) == [200, 200, 400]
    assert server.http is not None and server.http.rejected == {"bad_request": 1}


async def test_the_http_port_warns_of_what_its_protocol_cannot_carry_at_start_and_reload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY_HEAD + "  - {name: per-route, type: request_rate, rate: 1, burst: 3,"
                      " key: [{identity: true}, {route: true}]}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="off", http_listen="127.0.0.1:0",
                              admin_listen="off"))

    def warned() -> list[str]:
        found = [r.fields["problem"] for r in caplog.records  # type: ignore[attr-defined]
                 if getattr(r, "fields", {}).get("event") == "http_unreadable"]
        caplog.clear()
        return [p.split(" yields")[0] for p in found]

    caplog.set_level(logging.WARNING, logger="extauthz")
    await srv.start()
    try:
        assert warned() == ["limiter 'per-route': key part route"]
        policy.write_text(POLICY_HEAD + "  - {name: per-team, type: request_rate, rate: 1, burst: 3,"
                          " key: [{context_extension: team}]}\n")
        assert srv.watcher is not None and await srv.watcher.poll()
        assert warned() == ["limiter 'per-team': key part context_extension:team"]
        policy.write_text(POLICY)  # nothing the HTTP protocol cannot carry
        assert await srv.watcher.poll()
        assert warned() == []
    finally:
        await srv.stop(grace=0)


async def test_the_grpc_port_alone_has_nothing_to_warn_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY_HEAD + "  - {name: per-route, type: request_rate, rate: 1, burst: 3,"
                      " key: [{identity: true}, {route: true}]}\n")
    caplog.set_level(logging.WARNING, logger="extauthz")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off"))
    await srv.start()
    try:
        assert not [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "http_unreadable"]
    finally:
        await srv.stop(grace=0)


async def test_a_client_that_does_not_read_gets_its_answers_paused_then_is_cut_off(server: Server) -> None:
    """A client that pipelines and never reads: its answers stop at the write buffer's bound
    (reading with them), and once they have waited the header timeout (0.5 s here) the
    connection is aborted, dropping what it held."""
    front = server.http
    assert front is not None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.http_port))
        burst = request(key="sk_live_nr") * 2000  # ~100 KiB: far more answers than the buffers take
        sent, paused = 0, False
        async with asyncio.timeout(30):
            while front.rejected.get("not_reading", 0) == 0:
                try:
                    sent += sock.send(burst)
                except BlockingIOError:
                    pass
                for conn in front.connections:
                    if conn.write_paused:
                        assert conn.paused and conn.write_buffered() <= HttpLimits().max_write_buffer + 16 * 1024
                        paused = True
                await asyncio.sleep(0.01)
            for _ in range(3000):  # aborted: gone at connection_lost, a loop turn later
                if not front.connections:
                    break
                await asyncio.sleep(0.01)
        assert paused and front.rejected["not_reading"] == 1 and not front.connections
    finally:
        sock.close()
