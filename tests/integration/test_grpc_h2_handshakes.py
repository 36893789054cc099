"""TLS handshakes in progress count against the gRPC port's connection bound (``H2Limits.
max_connections``), on asyncio's loop and on uvloop (what ``serve`` runs): connections that
never send a ClientHello fill the bound, the next one (a real grpcio client with its
certificate) is refused, and once the handshake timeout has closed them the count is back;
connections sending garbage instead fail their handshake and give their place back at once,
long before the timeout."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from extauthz.proto import auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.grpc_h2 import GrpcH2Server, H2Limits, _Connection, _TlsListener

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
        #: the same client certificate for a raw TLS client (ALPN h2, as grpcio)
        self.raw = ssl.create_default_context(cafile=self.ca_path)
        self.raw.load_cert_chain(*envoy.write(directory / "envoy", "tls"))
        self.raw.set_alpn_protocols(["h2"])


async def serving(tmp_path: Path, tls: Tls, handshake_timeout: float, bound: int = BOUND,
                  listen: str = "127.0.0.1:0") -> tuple[Server, GrpcH2Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: user-rate, type: request_rate, rate: 1000, burst: 1000}\n")
    srv = Server(ServerConfig(
        policies=[str(policy)], listen=listen, admin_listen="off", grpc_server="asyncio",
        tls_cert=str(tls.cert), tls_key=str(tls.key), tls_client_ca=str(tls.ca_path),
        grpc_limits=H2Limits(max_connections=bound, handshake_timeout=handshake_timeout)))
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
        # long enough for a grpcio client to connect on a loaded machine before it ends them
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=3.0)
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




@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_accepts_pause_while_the_process_is_out_of_descriptors_and_resume(
        tmp_path: Path, loop: str, caplog: pytest.LogCaptureFixture) -> None:
    """EMFILE at accept: the TLS port stops reading its listening socket for a second (it
    neither spins on the readable socket nor raises out of the loop), the connection waits in
    the backlog, and once descriptors are free again it is accepted and its handshake runs."""
    tls = Tls(tmp_path)

    async def body() -> None:
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # made before the table fills
        fillers: list[int] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
            try:
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
            client.connect(("127.0.0.1", srv.port))  # the kernel completes it: in the backlog
            await until(lambda: any(getattr(r, "fields", {}).get("event") == "grpc_accept_paused"
                                    for r in caplog.records), "the accept paused on EMFILE")
            assert not h2.handshakes and counted(h2) == 0
            for fd in fillers:
                os.close(fd)
            fillers.clear()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await until(lambda: len(h2.handshakes) == 1, "the waiting connection accepted after the pause")
            assert counted(h2) == 1
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            client.close()
            await srv.stop(grace=0)
        assert not h2.handshakes

    with caplog.at_level(logging.WARNING, logger="extauthz"):
        LOOPS[loop](body())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_tls_port_binds_as_create_server_did(tmp_path: Path, loop: str) -> None:
    """The TLS port's own listening sockets (grpc_h2.listen_sockets): SO_REUSEPORT lets the
    workers share the port, a port taken without it is refused naming the flag, and an IPv6
    address listens on IPv6 only (as asyncio's and uvloop's create_server)."""
    tls = Tls(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)

    async def body() -> None:
        first, second, third = (GrpcH2Server(H2Limits(), ssl_context=ctx) for _ in range(3))
        port = await first.start("127.0.0.1:0", reuse_port=True, flag="--listen")
        try:
            assert await second.start(f"127.0.0.1:{port}", reuse_port=True, flag="--listen") == port
            with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(--listen\)"):
                await third.start(f"127.0.0.1:{port}", flag="--listen")
            assert third.server is None
            for srv in (first, second):
                assert isinstance(srv.server, _TlsListener)
                [sock] = srv.server.sockets
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        finally:
            await first.stop(0)
            await second.stop(0)
        if socket.has_ipv6:
            six = GrpcH2Server(H2Limits(), ssl_context=ctx)
            try:
                await six.start("[::1]:0")
            except OSError:
                return  # no IPv6 on this machine
            try:
                assert isinstance(six.server, _TlsListener)
                [sock] = six.server.sockets
                assert sock.family == socket.AF_INET6
                assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
            finally:
                await six.stop(0)

    LOOPS[loop](body())


def tls_closed_by_server(tls: Tls, port: int) -> bool:
    """A raw TLS client (its certificate, ALPN h2): True when the server closes the
    connection, during or right after the handshake, without a byte of HTTP/2."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        try:
            with tls.raw.wrap_socket(sock, server_hostname="extauthz") as conn:
                return conn.recv(4096) == b""
        except (ssl.SSLError, ConnectionResetError):
            return True


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_connection_made_counts_once_so_an_accept_at_the_bound_is_taken(
        tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS connection moves from ``handshakes`` to ``connections`` as it is made, in one
    step: a loop turn or two passed before its handshake task ended, and meanwhile it counted
    in both, so with a bound of 2 a second connection accepted in that moment was refused
    (too_many_connections) though one place was free. The accept is made in that very turn:
    the client's connect is complete in the kernel, and the listener's accept is called from
    the first connection's ``connection_made`` (what its reader would do a turn later)."""
    tls = Tls(tmp_path)

    async def body() -> None:
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0, bound=2)
        listener = h2.server
        assert isinstance(listener, _TlsListener)
        at_made: list[int] = []
        second: list[socket.socket] = []
        made = _Connection.connection_made

        def connection_made(conn: _Connection, transport: asyncio.BaseTransport) -> None:
            made(conn, transport)
            at_made.append(counted(h2))
            if second:
                return
            waiting = len(h2.handshakes)
            second.append(socket.create_connection(("127.0.0.1", srv.port)))
            for _ in range(1000):  # the kernel queues it for accept within a moment (bounded)
                for sock in listener.sockets:
                    listener._accept(sock)
                if len(h2.handshakes) > waiting or h2.rejected:
                    return
                time.sleep(0.001)

        monkeypatch.setattr(_Connection, "connection_made", connection_made)
        try:
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
            assert "too_many_connections" not in h2.rejected, h2.rejected
            assert at_made[0] == 1  # the first connection, counted once as it was made
            assert len(h2.handshakes) == 1  # the second, accepted: its handshake waits
            second[0].close()  # it ends without a ClientHello: counted, its place given back
            await until(lambda: not h2.handshakes and not h2.connections, "both connections gone")
            assert counted(h2) == 0 and h2.rejected == {"tls_handshake": 1}
        finally:
            for s in second:
                s.close()
            await srv.stop(grace=0)

    LOOPS[loop](body())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_an_error_of_the_server_in_a_handshake_is_counted_logged_and_closed(
        tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Anything but an OSError out of ``connect_accepted_socket`` (here the protocol's own
    ``connection_made`` raising, which both loops pass out through the handshake's waiter):
    counted as handshake_error, logged (throttled), the socket closed and its place given
    back, and never raised out of the handshake task (it was logged by the loop as "Task
    exception was never retrieved", uncounted); the port then serves as before."""
    tls = Tls(tmp_path)

    async def body() -> None:
        srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0)
        loop_errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))

        def connection_made(conn: _Connection, transport: asyncio.BaseTransport) -> None:
            raise RuntimeError("a bug in connection_made")

        try:
            with monkeypatch.context() as patch:
                patch.setattr(_Connection, "connection_made", connection_made)
                for _ in range(2):
                    assert await in_thread(tls_closed_by_server, tls, srv.port)
                await until(lambda: h2.rejected.get("handshake_error") == 2, "the two errors counted")
            assert not h2.handshakes and counted(h2) == 0
            gc.collect()  # the tasks (an exception's frames hold cycles): a retrieved one logs nothing
            await asyncio.sleep(0)
            assert [c["message"] for c in loop_errors if "task" in c or "future" in c] == []
            logged = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "grpc_handshake_error"]
            assert len(logged) == 1 and logged[0].levelno == logging.ERROR  # the second held back
            assert logged[0].exc_info is not None and "a bug in connection_made" in str(logged[0].exc_info[1])
            [refused] = [m for m in h2.metrics() if m.name == "extauthz_grpc_connections_refused"]
            assert {s.labels["reason"]: s.value for s in refused.samples if s.name.endswith("_total")}[
                "handshake_error"] == 2
            assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
        finally:
            await srv.stop(grace=0)

    with caplog.at_level(logging.WARNING, logger="extauthz"):
        LOOPS[loop](body())


def missing_family() -> socket.AddressFamily:
    """An address family this kernel makes no sockets of (EAFNOSUPPORT), as a kernel built
    without IPv6 makes none of AF_INET6."""
    for name in ("AF_IPX", "AF_APPLETALK", "AF_DECnet", "AF_X25", "AF_ROSE"):
        family = getattr(socket, name, None)
        if family is None:
            continue
        try:
            socket.socket(family, socket.SOCK_STREAM).close()
        except OSError as exc:
            if exc.errno == errno.EAFNOSUPPORT:
                return family  # type: ignore[no-any-return]
    pytest.skip("every address family tried has sockets on this kernel")


#: an IPv4 address of no machine (TEST-NET-1): its bind is EADDRNOTAVAIL, as ::1's is on a
#: kernel whose IPv6 is disabled
NOT_HERE = "192.0.2.1"


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_tls_port_skips_an_address_it_cannot_listen_on_as_create_server_does(
        tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A name that resolves to an address of a family the kernel lacks (``localhost``'s
    ``::1`` without IPv6) or to one it cannot bind (EADDRNOTAVAIL) beside one it can: the TLS
    port listens on the one it can, with a warning naming each skipped (it refused to start;
    ``create_server``, which the plaintext port runs, skips the first, Python 3.13's the second
    too). None it can: the start fails naming the flag and every address."""
    if Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() != "0":
        pytest.skip("this kernel binds addresses it does not have (ip_nonlocal_bind)")
    tls = Tls(tmp_path)
    lacking = missing_family()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """``*.test`` names: their addresses, each as getaddrinfo gives them (other names as
        the system resolves them)."""
        entries = {"v6-missing.test": [(lacking, ("::1", port, 0, 0)), (socket.AF_INET, ("127.0.0.1", port))],
                   "not-here.test": [(socket.AF_INET, (NOT_HERE, port)), (socket.AF_INET, ("127.0.0.1", port))],
                   "none.test": [(lacking, ("::1", port, 0, 0)), (socket.AF_INET, (NOT_HERE, port))]}
        if host not in entries:
            return real(host, port, *args, **kwargs)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)
                for family, address in entries[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def body() -> None:
        for name, skipped in (("v6-missing.test", "::1"), ("not-here.test", NOT_HERE)):
            caplog.clear()
            srv, h2 = await serving(tmp_path, tls, handshake_timeout=300.0, listen=f"{name}:0")
            try:
                assert isinstance(h2.server, _TlsListener)
                assert [s.getsockname()[0] for s in h2.server.sockets] == ["127.0.0.1"]
                warned = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "grpc_listen_skipped"]
                assert [(r.levelno, r.fields["address"]) for r in warned] == [(logging.WARNING, skipped)]  # type: ignore[attr-defined]
                assert await in_thread(grpcio_check, srv.port, tls.client) == grpc.StatusCode.OK
            finally:
                await srv.stop(grace=0)
        none = GrpcH2Server(H2Limits(), ssl_context=ssl.create_default_context(ssl.Purpose.CLIENT_AUTH))
        with pytest.raises(OSError, match=r"cannot listen on none.test:0 \(--listen\): no address of none.test "
                           rf"could listen \(::1: .+; {NOT_HERE}: Cannot assign requested address\)") as raised:
            await none.start("none.test:0", flag="--listen")
        assert raised.value.errno == errno.EADDRNOTAVAIL and none.server is None

    with caplog.at_level(logging.WARNING, logger="extauthz"):
        LOOPS[loop](body())
