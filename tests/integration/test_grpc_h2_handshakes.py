"""TLS handshakes in progress count against the gRPC port's connection bound (``H2Limits.
max_connections``), on asyncio's loop and on uvloop (what ``serve`` runs): connections that
never send a ClientHello fill the bound, the next one (a real grpcio client with its
certificate) is refused, and once the handshake timeout has closed them the count is back;
connections sending garbage instead fail their handshake and give their place back at once,
long before the timeout."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from extauthz.proto import auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.grpc_h2 import GrpcH2Server, H2Limits

from ..infra.certs import CA
from .test_server import check_request

BOUND = 4
WAIT = 10.0
LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


class Tls:
    def __init__(self, directory: Path) -> None:
        ca = CA()
        self.ca_path = ca.write(directory / "ca.crt")
        leaf = ca.issue("extauthz", dns=("extauthz",), ips=("127.0.0.1",))
        self.cert, self.key = leaf.write(directory / "server", "tls")
        envoy = ca.issue("envoy")
        self.client = grpc.ssl_channel_credentials(ca.pem, envoy.key_pem, envoy.cert_pem)


async def serving(tmp_path: Path, tls: Tls, handshake_timeout: float) -> tuple[Server, GrpcH2Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: user-rate, type: request_rate, rate: 1000, burst: 1000}\n")
    srv = Server(ServerConfig(
        policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off", grpc_server="asyncio",
        tls_cert=str(tls.cert), tls_key=str(tls.key), tls_client_ca=str(tls.ca_path),
        grpc_limits=H2Limits(max_connections=BOUND, handshake_timeout=handshake_timeout)))
    await srv.start()
    assert isinstance(srv.grpc, GrpcH2Server)
    return srv, srv.grpc


def grpcio_check(port: int, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    """One Check by grpcio's own client over mTLS: OK, or the code it failed with."""
    options = (("grpc.ssl_target_name_override", "extauthz"),)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as ch:
        try:
            resp = auth_pb2_grpc.AuthorizationStub(ch).Check(check_request(), timeout=WAIT)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    assert resp.status.code == 0
    return grpc.StatusCode.OK


def counted(h2: GrpcH2Server) -> int:
    """What the port counts against its bound (the gauge extauthz_grpc_connections)."""
    [gauge] = [m for m in h2.metrics() if m.name == "extauthz_grpc_connections"]
    return int(gauge.samples[0].value)


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {WAIT} s: {what}")


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(WAIT)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_handshakes_that_never_start_fill_the_bound_until_the_timeout(tmp_path: Path, loop: str) -> None:
    tls = Tls(tmp_path)

    async def body() -> None:
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=1.0)
        silent: list[socket.socket] = []
        try:
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
            await until(lambda: not h2.connections, "the first client's connection closed")
            # BOUND connections that never send a ClientHello
            silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(BOUND)]
            await until(lambda: len(h2.handshakes) == BOUND, "the silent connections accepted")
            assert counted(h2) == BOUND and h2.status()["handshakes"] == BOUND
            # one more, a real client with its certificate: refused at once, the bound held
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.UNAVAILABLE
            assert h2.rejected["too_many_connections"] >= 1 and counted(h2) == BOUND
            # the handshake timeout closes them: the count is back, the client is served
            await until(lambda: not h2.handshakes, "the silent handshakes timed out")
            assert h2.rejected["handshake_timeout"] == BOUND and counted(h2) == 0
            assert all([await in_thread(closed_by_server, s) for s in silent])
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
        finally:
            for s in silent:
                s.close()
            await srv.stop(grace=0)

    LOOPS[loop](body())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_failed_handshakes_give_their_place_back_at_once(tmp_path: Path, loop: str) -> None:
    tls = Tls(tmp_path)

    async def body() -> None:
        # a timeout longer than the test: only the failure itself can release the count
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0)
        garbage: list[socket.socket] = []
        try:
            for _ in range(3):  # more failures than the bound holds, in rounds
                for _ in range(BOUND):
                    s = socket.create_connection(("127.0.0.1", srv.port))
                    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" + bytes(range(256)))
                    garbage.append(s)
                await until(lambda: not h2.handshakes and h2.rejected.get("tls_handshake", 0) == len(garbage),
                            "the garbage handshakes failed and released")
            assert counted(h2) == 0 and "handshake_timeout" not in h2.rejected
            assert all([await in_thread(closed_by_server, s) for s in garbage])
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
        finally:
            for s in garbage:
                s.close()
            await srv.stop(grace=0)

    LOOPS[loop](body())


def test_a_stop_ends_the_handshakes_in_progress(tmp_path: Path) -> None:
    tls = Tls(tmp_path)

    async def body() -> None:
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0)
        silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        try:
            await until(lambda: len(h2.handshakes) == 2, "accepted")
            await asyncio.wait_for(srv.stop(grace=0), WAIT)
            assert not h2.handshakes
            assert all([await in_thread(closed_by_server, s) for s in silent])
        finally:
            for s in silent:
                s.close()

    uvloop.run(body())


