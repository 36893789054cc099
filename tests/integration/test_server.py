"""The gRPC server in-process and as a process: Check, health, malformed input, SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extauthz.devtools.stack import ServerProcess
from extauthz.proto import auth_pb2, auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.grpc_h2 import GrpcH2Server

from ..conftest import ROOT


def check_request(key: str = "sk_live_x", method: str = "GET", path: str = "/v1/x") -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = method, path, "api.example.com"
    http.headers["x-api-key"] = key
    http.headers["x-request-id"] = "req-1"
    req.attributes.source.address.socket_address.address = "10.1.2.3"
    return req


@pytest.fixture
async def server(tmp_path: Path, grpc_server_kind: str) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: user-rate, type: request_rate, rate: 1, burst: 2}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="127.0.0.1:0",
                              grpc_server=grpc_server_kind))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


async def test_check_allows_then_refuses_with_429(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = auth_pb2_grpc.AuthorizationStub(ch)
        ok = await stub.Check(check_request())
        assert ok.status.code == 0 and ok.HasField("ok_response")
        headers = {h.header.key: h.header.value for h in ok.ok_response.headers}
        assert headers == {"x-extauthz-tier": "get"}
        await stub.Check(check_request())
        denied = await stub.Check(check_request())
        assert denied.HasField("denied_response") and denied.denied_response.status.code == 429
        assert denied.status.code == 8  # RESOURCE_EXHAUSTED
        resp_headers = {h.header.key: h.header.value for h in denied.denied_response.headers}
        assert resp_headers["retry-after"] == "1" and resp_headers["content-type"] == "application/problem+json"


async def test_malformed_request_is_decided_safely(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = auth_pb2_grpc.AuthorizationStub(ch)
        empty = await stub.Check(auth_pb2.CheckRequest())  # no attributes at all
        assert empty.status.code == 0 and empty.HasField("ok_response")
        weird = check_request(method="BREW", path="/?%%%")
        weird.attributes.route_metadata_context.filter_metadata["extauthz"].update({"tier": 42})
        resp = await stub.Check(weird)
        assert resp.status.code == 0
        assert {h.header.key: h.header.value for h in resp.ok_response.headers}["x-extauthz-tier"] == "post"


async def test_health_serving_then_not_serving_on_stop(tmp_path: Path, grpc_server_kind: str) -> None:
    srv = Server(ServerConfig(policies=[str(ROOT / "policies")], listen="127.0.0.1:0", admin_listen="127.0.0.1:0",
                              grpc_server=grpc_server_kind))
    await srv.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "envoy.service.auth.v3.Authorization"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await srv.health.enter_graceful_shutdown()
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await srv.stop(grace=0)


def test_sigterm_stops_gracefully(tmp_path: Path, grpc_server_kind: str) -> None:
    proc = ServerProcess([ROOT / "policies"], workdir=tmp_path, args=["--grpc-server", grpc_server_kind]).start()
    assert proc.proc is not None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
            stub = auth_pb2_grpc.AuthorizationStub(ch)
            # the quick start's shedders refuse while a busy machine starves the fresh process
            # (503 "overload"): it answers allowed once fed (bounded)
            for _ in range(50):
                if (code := stub.Check(check_request(), timeout=5).status.code) == 0:
                    break
                time.sleep(0.1)
            assert code == 0
        proc.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.proc.wait(10) == 0
        assert time.monotonic() - started < 8
        assert "NOT_SERVING" in proc.log()
    finally:
        proc.stop()


def test_bad_policy_refuses_to_start_with_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nlimiters:\n  - {name: r, type: request_rate, rate: 1}\n")
    proc = ServerProcess([bad], workdir=tmp_path)
    with pytest.raises(RuntimeError, match="exited with 2"):
        proc.start(timeout=10)
    assert f"{bad}:3: limiters[0].burst: required field is missing" in proc.log()


def test_lease_index_by_request_id() -> None:
    from extauthz.server.leases import LeaseIndex

    idx = LeaseIndex(limit=2)
    idx.put("r1", ("k1",), "a", "t:1")
    idx.put("r1", ("k1",), "b", "t:2")  # a client reusing its x-request-id
    assert idx.take("r1", "b") == (("k1",), "b")
    assert idx.take("r1", "zz") is None  # not ours
    # two checks saw r1: an entry without our metadata identifies neither (never "the oldest")
    assert idx.take("r1", None, ("t:1",)) is None
    assert idx.take("r1", "a") == (("k1",), "a") and len(idx) == 0
    for rid in ("x", "y", "z"):
        idx.put(rid, ("k",), rid, "t:1")
    assert len(idx) == 2 and idx.take("x", None, ("t:1",)) is None  # the oldest was forgotten
    assert idx.take("y", None, ("t:1",)) == (("k",), "y")


async def test_access_log_releases_with_or_without_our_metadata(tmp_path: Path, grpc_server_kind: str) -> None:
    """Envoy logs every finished request; when it dropped our answer (client gone, ext_authz
    timeout) the entry lacks the lease metadata, and the request id finds the leases."""
    from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
    from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: conc, type: concurrent_requests, limit: 2}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="127.0.0.1:0",
                              grpc_server=grpc_server_kind))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            auth = auth_pb2_grpc.AuthorizationStub(ch)
            answers = []
            for rid in ("req-a", "req-b"):
                req = check_request()
                req.attributes.request.http.headers["x-request-id"] = rid
                req.attributes.request.time.FromMicroseconds(1_795_000_000_123_456)  # stream start
                answers.append(await auth.Check(req))
            assert (await auth.Check(check_request())).HasField("denied_response")  # limit 2 held

            msg = accesslog_pb2.StreamAccessLogsMessage()
            with_md = msg.http_logs.log_entry.add()  # Envoy got our answer: metadata present
            with_md.request.request_id = "req-a"
            with_md.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].CopyFrom(
                answers[0].dynamic_metadata)
            without = msg.http_logs.log_entry.add()  # Envoy dropped our answer: no metadata
            without.request.request_id = "req-b"
            without.common_properties.start_time.FromMicroseconds(1_795_000_000_123_456)  # the same stream
            stub = accesslog_pb2_grpc.AccessLogServiceStub(ch)

            async def stream():  # type: ignore[no-untyped-def]
                yield msg

            await stub.StreamAccessLogs(stream())
            assert srv.engine.releaser.leases_released == 2 and srv.engine.releaser.count("request_id_index") == 1
            assert (await auth.Check(check_request())).HasField("ok_response")

            # A request we refused, reusing an admitted request's (client-chosen) request id:
            # its entry (Envoy flags it UAEX) must not take the admitted request's leases.
            dup = check_request()
            dup.attributes.request.http.headers["x-request-id"] = "req-dup"
            assert (await auth.Check(dup)).HasField("ok_response")  # 2 of 2 held again
            assert (await auth.Check(dup)).HasField("denied_response")
            refused = accesslog_pb2.StreamAccessLogsMessage()
            entry = refused.http_logs.log_entry.add()
            entry.request.request_id = "req-dup"
            entry.common_properties.response_flags.unauthorized_details.reason = 1  # EXTERNAL_SERVICE

            async def refused_stream():  # type: ignore[no-untyped-def]
                yield refused

            await stub.StreamAccessLogs(refused_stream())
            assert srv.engine.releaser.leases_released == 2  # nothing taken
            assert (await auth.Check(check_request())).HasField("denied_response")
    finally:
        await srv.stop(grace=0)


async def test_the_health_listen_port_serves_health_only(tmp_path: Path, grpc_server_kind: str) -> None:
    """``--health-listen`` is plaintext for the kubelet's probes: it must not become a way
    around the main port's TLS, so Check and the access log are not served there."""
    from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: user-rate, type: request_rate, rate: 1, burst: 2}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              health_listen="127.0.0.1:0", grpc_server=grpc_server_kind))
    await srv.start()
    try:
        assert srv.health_port and srv.health_port != srv.port
        # the health port is served by the same kind of server as the main port
        assert isinstance(srv.health_grpc, GrpcH2Server) == (grpc_server_kind == "asyncio")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.health_port}") as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await auth_pb2_grpc.AuthorizationStub(ch).Check(check_request())
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

            async def entries():  # type: ignore[no-untyped-def]
                yield accesslog_pb2.StreamAccessLogsMessage()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await accesslog_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(entries())
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert srv.accesslog.entries == 0
    finally:
        await srv.stop(grace=0)


async def test_a_kubernetes_health_probe_on_the_main_and_health_ports(tmp_path: Path, grpc_server_kind: str) -> None:
    """grpc_health_probe's way (a fresh plaintext connection per probe, Health/Check, 1 s):
    SERVING on both ports, probe after probe, then NOT_SERVING once the stop begins."""
    import asyncio

    from ..infra.probe import health_probe

    srv = Server(ServerConfig(policies=[str(ROOT / "policies")], listen="127.0.0.1:0", admin_listen="off",
                              health_listen="127.0.0.1:0", grpc_server=grpc_server_kind))
    await srv.start()
    try:
        for port in (srv.port, srv.health_port):
            for service in ("", "envoy.service.auth.v3.Authorization", "envoy.service.accesslog.v3.AccessLogService"):
                assert await asyncio.to_thread(health_probe, f"127.0.0.1:{port}", service=service) == "SERVING"
            for _ in range(5):  # the kubelet probes every period, each time on a new connection
                assert await asyncio.to_thread(health_probe, f"127.0.0.1:{port}") == "SERVING"
            assert await asyncio.to_thread(health_probe, f"127.0.0.1:{port}", service="nope") == "NOT_FOUND"
        await srv.health.enter_graceful_shutdown()
        for port in (srv.port, srv.health_port):
            assert await asyncio.to_thread(health_probe, f"127.0.0.1:{port}") == "NOT_SERVING"
    finally:
        await srv.stop(grace=0)


async def test_the_grpc_ports_bounds_are_on_the_metrics_port(tmp_path: Path) -> None:
    from tests.observe.helpers import http

    srv = Server(ServerConfig(policies=[str(ROOT / "policies")], listen="127.0.0.1:0", admin_listen="off",
                              metrics_listen="127.0.0.1:0"))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            assert (await auth_pb2_grpc.AuthorizationStub(ch).Check(check_request())).status.code == 0
            status, body = await http("GET", f"http://127.0.0.1:{srv.ports.metrics_port}/metrics")
        assert status == 200
        assert "extauthz_grpc_connections 1.0" in body
        assert "extauthz_grpc_calls_total 1.0" in body
        assert 'extauthz_grpc_goaways_sent_total{code="ENHANCE_YOUR_CALM"} 0.0' in body
    finally:
        await srv.stop(grace=0)
