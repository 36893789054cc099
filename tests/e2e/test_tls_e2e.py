"""mTLS on the gRPC port end to end: a real Envoy (envoy/envoy-tls.yaml) with certificates
made in the test; Check and access-log release work over mTLS; clients without a
certificate or with one from another CA are refused at the handshake; a certificate rotated
on disk is served without a restart, and a bad rotation keeps the last good one."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extauthz.devtools.client import HttpClient
from extauthz.devtools.envoy_config import local_render
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import free_port, wait_for_health
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy.config import TlsFiles
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
from extauthz.policy import load_policy
from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc, auth_pb2, auth_pb2_grpc, rls_pb2, rls_pb2_grpc
from testinfra.envoy_configs import validate

from ..conftest import ROOT
from ..infra.certs import CA, Leaf
from ..infra.probe import health_probe

pytestmark = pytest.mark.e2e

POLICY = {
    "version": 1,
    "identity": [{"header": "x-api-key"}],
    "limiters": [{"name": "one-at-a-time", "type": "concurrent_requests", "limit": 1}],
}
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Pki:
    dir: Path
    ca: CA
    server: Leaf
    envoy: Leaf
    stranger: Leaf  # signed by another CA

    @property
    def ca_path(self) -> Path:
        return self.dir / "ca.crt"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA(), CA("another CA")
    p = Pki(d, ca, ca.issue("extauthz", dns=("extauthz", "localhost"), ips=("127.0.0.1",)),
            ca.issue("envoy", uris=("spiffe://example/envoy",)), other.issue("stranger"))
    ca.write(p.ca_path)
    p.server.write(d / "server", "tls")
    p.envoy.write(d / "envoy", "tls")
    return p


def envoy_config(pki: Pki, extauthz_port: int, upstream_port: int) -> str:
    """envoy/envoy-tls.yaml's options (the quick start's, with mTLS) with this run's ports and files."""
    return local_render(load_policy([ROOT / "policies"]), protocol="grpc", grpc_port=extauthz_port,
                        upstream_port=upstream_port, quickstart_routes=True,
                        tls=TlsFiles(f"{pki.dir}/envoy/tls.crt", f"{pki.dir}/envoy/tls.key", str(pki.ca_path)))


@dataclass
class TlsServer:
    proc: subprocess.Popen[bytes]
    port: int
    health_port: int
    admin_port: int
    log: Path

    def status(self) -> dict[str, Any]:
        with _OPENER.open(f"http://127.0.0.1:{self.admin_port}/status", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(pki: Pki, tmp_path_factory: pytest.TempPathFactory, grpc_server_kind: str) -> Iterator[TlsServer]:
    d = tmp_path_factory.mktemp("server")
    (d / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    port, health_port, admin_port = free_port(), free_port(), free_port()
    log = d / "server.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EXTAUTHZ_")},
           "EXTAUTHZ_TLS_CERT": str(pki.dir / "server" / "tls.crt"),
           "EXTAUTHZ_TLS_KEY": str(pki.dir / "server" / "tls.key"),
           "EXTAUTHZ_TLS_CLIENT_CA": str(pki.ca_path), "XDG_RUNTIME_DIR": str(d)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "extauthz", "serve", "--policies", str(d / "policy.yaml"),
             "--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health_port}",
             "--admin-listen", f"127.0.0.1:{admin_port}", "--grpc-server", grpc_server_kind],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_health(health_port, 30, proc, log)  # the plaintext health-only port
        yield TlsServer(proc, port, health_port, admin_port, log)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with start_upstream("127.0.0.1") as u:
        yield u


def _check_request(key: str = "k") -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    req.attributes.request.http.method = "GET"
    req.attributes.request.http.path = "/v1/x"
    req.attributes.request.http.headers["x-api-key"] = key
    return req


def _grpc_check(port: int, credentials: grpc.ChannelCredentials | None) -> auth_pb2.CheckResponse:
    target = f"127.0.0.1:{port}"
    options = [("grpc.ssl_target_name_override", "extauthz")]
    channel = (grpc.insecure_channel(target) if credentials is None
               else grpc.secure_channel(target, credentials, options=options))
    with channel:
        # a fresh identity per call: a direct Check's lease is never released by an access log
        return auth_pb2_grpc.AuthorizationStub(channel).Check(_check_request(os.urandom(6).hex()), timeout=5)


def _served_certificate(port: int, pki: Pki) -> bytes:
    """The DER certificate a new mTLS handshake gets."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_path))
    ctx.load_cert_chain(pki.dir / "envoy" / "tls.crt", pki.dir / "envoy" / "tls.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname="extauthz") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_check_and_release_through_envoy_over_mtls(pki: Pki, server: TlsServer, upstream: Upstream) -> None:
    config = envoy_config(pki, server.port, upstream.port)
    validate(config)
    with EnvoyProcess(config) as envoy, HttpClient() as client:
        for i in range(3):
            before = server.status()["lease_releases"]["leases_released"]
            r = client.send(envoy.url + "/v1/things", headers={"x-api-key": "alice"})
            assert r.status == 200, r.body
            assert "x-envoy-auth-failure-mode-allowed" not in r.body  # the Check really answered
            assert r.tier == "get"
            deadline = time.monotonic() + 5
            while server.status()["lease_releases"]["leases_released"] <= before:  # freed over the log stream
                assert time.monotonic() < deadline, f"lease {i} never released"
                time.sleep(0.02)
        stats = envoy.stats(r"^cluster\.extauthz\.ssl\.handshake$")
        assert stats["cluster.extauthz.ssl.handshake"] >= 1
    tls = server.status()["tls"]
    assert (tls["enabled"], tls["mtls"], tls["cert"]) == (True, True, str(pki.dir / "server" / "tls.crt"))


def test_clients_without_a_good_certificate_are_refused_at_the_handshake(pki: Pki, server: TlsServer) -> None:
    ca = pki.ca.pem
    good = grpc.ssl_channel_credentials(ca, pki.envoy.key_pem, pki.envoy.cert_pem)
    assert _grpc_check(server.port, good).status.code == 0
    refused = {
        "no certificate": grpc.ssl_channel_credentials(ca),
        "another CA": grpc.ssl_channel_credentials(ca, pki.stranger.key_pem, pki.stranger.cert_pem),
        "plaintext": None,
    }
    for what, credentials in refused.items():
        with pytest.raises(grpc.RpcError) as err:
            _grpc_check(server.port, credentials)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_certificate_rotated_on_disk_is_served_without_restart(pki: Pki, server: TlsServer) -> None:
    cert, key = pki.dir / "server" / "tls.crt", pki.dir / "server" / "tls.key"
    assert _served_certificate(server.port, pki) == pki.server.der
    failures = server.status()["tls"]["reload_failures"]

    # a bad rotation (a key that does not match) keeps the last good certificate, counted
    rotated = pki.ca.issue("extauthz", dns=("extauthz",), ips=("127.0.0.1",))
    cert.write_bytes(rotated.cert_pem)
    assert _served_certificate(server.port, pki) == pki.server.der
    tls = server.status()["tls"]
    assert tls["reload_failures"] == failures + 1 and "not a matching" in tls["last_error"]

    # the key lands: the next handshake gets the new certificate; the process never restarted
    key.write_bytes(rotated.key_pem)
    assert _served_certificate(server.port, pki) == rotated.der
    tls = server.status()["tls"]
    assert (tls["reloads"], tls["reload_failures"], tls["last_error"]) == (1, failures + 1, None)
    assert server.proc.poll() is None
    good = grpc.ssl_channel_credentials(pki.ca.pem, pki.envoy.key_pem, pki.envoy.cert_pem)
    assert _grpc_check(server.port, good).status.code == 0
    # put the original back for other tests (module-scoped server)
    pki.server.write(pki.dir / "server", "tls")


def test_a_kubernetes_health_probe_over_mtls_and_on_the_plaintext_health_port(pki: Pki, server: TlsServer) -> None:
    """grpc_health_probe with ``-tls -tls-ca-cert -tls-client-cert -tls-client-key`` on the
    main port, and plaintext on ``--health-listen`` (the kubelet's own gRPC probe has no TLS);
    a probe without a client certificate is refused at the handshake."""
    good = grpc.ssl_channel_credentials(pki.ca.pem, pki.envoy.key_pem, pki.envoy.cert_pem)
    for _ in range(3):  # a fresh connection per probe, as the kubelet runs it
        assert health_probe(f"127.0.0.1:{server.port}", good, server_name="extauthz") == "SERVING"
        assert health_probe(f"127.0.0.1:{server.health_port}") == "SERVING"
    no_certificate = grpc.ssl_channel_credentials(pki.ca.pem)
    assert health_probe(f"127.0.0.1:{server.port}", no_certificate, server_name="extauthz") == "UNAVAILABLE"
    assert health_probe(f"127.0.0.1:{server.port}") == "UNAVAILABLE"  # plaintext on the TLS port


def test_every_method_with_grpcio_client_over_mtls(pki: Pki, server: TlsServer) -> None:
    """grpcio's own client over mTLS on one channel, every call shape the port serves: unary
    (Check, ShouldRateLimit, health Check), server streaming (health Watch), client streaming
    (the access log: the Check's lease released by its entry)."""
    good = grpc.ssl_channel_credentials(pki.ca.pem, pki.envoy.key_pem, pki.envoy.cert_pem)
    with grpc.secure_channel(f"127.0.0.1:{server.port}", good,
                             options=[("grpc.ssl_target_name_override", "extauthz")]) as channel:
        answer = auth_pb2_grpc.AuthorizationStub(channel).Check(_check_request(os.urandom(6).hex()), timeout=5)
        assert answer.status.code == 0 and answer.dynamic_metadata.fields  # the concurrency lease
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        limited = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="extauthz", hits_addend=1), timeout=5)
        assert limited.overall_code in (rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.UNKNOWN)
        before = server.status()["lease_releases"]["leases_released"]
        msg = accesslog_pb2.StreamAccessLogsMessage()
        entry = msg.http_logs.log_entry.add()
        entry.request.request_id = "r1"
        entry.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].CopyFrom(answer.dynamic_metadata)
        reply = accesslog_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([msg]), timeout=5)
        assert isinstance(reply, accesslog_pb2.StreamAccessLogsResponse)
    deadline = time.monotonic() + 5
    while server.status()["lease_releases"]["leases_released"] <= before:  # released by the entry
        assert time.monotonic() < deadline, "the lease was never released"
        time.sleep(0.02)
