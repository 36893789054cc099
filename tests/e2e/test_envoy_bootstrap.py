"""``extauthz envoy-config`` (extauthz/envoy_bootstrap.py): the shipped configs are its output
(plus the quick start's demo routes and tracing, and nothing else), every variant passes
``envoy --mode validate``, the access log appears only for a policy holding leases, and a
rendered config runs in front of the server with real decisions."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.envoy_config import validate
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.devtools.upstream import start_upstream
from extauthz.envoy_bootstrap import TlsFiles, bootstrap, holds_leases, render
from extauthz.policy import load_policy

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

TLS_DIR = "/etc/envoy/extauthz-tls"
TLS = TlsFiles(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
#: shipped file -> the envoy-config flags that render it
SHIPPED: dict[str, dict[str, Any]] = {
    "envoy.yaml": {"protocol": "grpc"},
    "envoy-http.yaml": {"protocol": "http"},
    "envoy-tls.yaml": {"protocol": "grpc", "tls": TLS},
}
#: the routes every rendered config has; the shipped files add the quick start's demo routes
RENDERED_ROUTES = ("healthz", "default")
RATE_ONLY = ("version: 1\nidentity: [{header: x-api-key}]\n"
             "limiters:\n  - {name: r, type: request_rate, rate: 0.001, burst: 2}\n")


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return manager["typed_config"]  # type: ignore[no-any-return]


def without_quickstart_extras(config: dict[str, Any]) -> dict[str, Any]:
    """The shipped file minus what only the quick start has: HCM tracing with its collector
    cluster, and the demo routes (route-metadata and context-extension tiers, per-route tier
    headers on HTTP) between /healthz and the catch-all."""
    out = copy.deepcopy(config)
    manager = hcm(out)
    assert manager.pop("tracing")["provider"]["name"] == "envoy.tracers.opentelemetry"
    clusters = out["static_resources"]["clusters"]
    assert [c["name"] for c in clusters][-1] == "otel_collector"
    out["static_resources"]["clusters"] = clusters[:-1]
    [vhost] = manager["route_config"]["virtual_hosts"]
    names = [r["name"] for r in vhost["routes"]]
    assert names[0] == "healthz" and names[-1] == "default"
    vhost["routes"] = [r for r in vhost["routes"] if r["name"] in RENDERED_ROUTES]
    return out


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_config_is_the_rendered_one_plus_the_quickstart_routes_and_tracing(name: str) -> None:
    shipped = yaml.safe_load((ROOT / "envoy" / name).read_text())
    rendered = bootstrap(load_policy([ROOT / "policies"]), upstream=("127.0.0.1", 8080), **SHIPPED[name])
    assert without_quickstart_extras(shipped) == rendered


def variants() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for protocol in ("grpc", "http"):
        for access_log in ("auto", "always", "never"):
            out.append((f"{protocol}-{access_log}", {"protocol": protocol, "access_log": access_log}))
    out.append(("grpc-tls-names", {"protocol": "grpc", "tls": TLS, "authz": ("extauthz.extauthz", 9001),
                                   "upstream": ("api.default", 8080)}))
    out.append(("grpc-separate-log", {"protocol": "grpc", "access_log_to": ("127.0.0.1", 9101)}))
    out.append(("http-names", {"protocol": "http", "authz": ("extauthz.extauthz", 9003),
                               "access_log_to": ("extauthz.extauthz", 9001), "listen_port": 8000}))
    return out


@pytest.mark.parametrize(("label", "options"), variants(), ids=[v[0] for v in variants()])
def test_every_variant_passes_envoy_validation(label: str, options: dict[str, Any], tmp_path: Path) -> None:
    options = {"upstream": ("127.0.0.1", 8080), **options}
    if "tls" in options:  # real files for Envoy to load
        from ..infra.certs import CA

        ca = CA()
        ca.write(tmp_path / "ca.crt")
        ca.issue("envoy").write(tmp_path, "tls")
        options["tls"] = TlsFiles(f"{tmp_path}/tls.crt", f"{tmp_path}/tls.key", f"{tmp_path}/ca.crt")
    validate(render(load_policy([ROOT / "policies"]), **options))


def test_access_log_only_when_the_policy_holds_leases(tmp_path: Path) -> None:
    (tmp_path / "api.yaml").write_text(RATE_ONLY)
    rate_only, quickstart = load_policy([tmp_path]), load_policy([ROOT / "policies"])
    assert not holds_leases(rate_only) and holds_leases(quickstart)
    for protocol in ("grpc", "http"):
        lean = bootstrap(rate_only, protocol=protocol, upstream=("127.0.0.1", 8080))
        assert "access_log" not in hcm(lean)
        names = [c["name"] for c in lean["static_resources"]["clusters"]]
        assert names == (["extauthz"] if protocol == "grpc" else ["extauthz_http"]) + ["upstream"]
        assert "access_log" in hcm(bootstrap(rate_only, protocol=protocol, upstream=("127.0.0.1", 8080),
                                             access_log="always"))
        assert "access_log" in hcm(bootstrap(quickstart, protocol=protocol, upstream=("127.0.0.1", 8080)))
        assert "access_log" not in hcm(bootstrap(quickstart, protocol=protocol, upstream=("127.0.0.1", 8080),
                                                 access_log="never"))


def test_allowed_headers_follow_the_policy(tmp_path: Path) -> None:
    (tmp_path / "api.yaml").write_text(RATE_ONLY.replace("x-api-key", "x-team-key"))
    config = bootstrap(load_policy([tmp_path]), protocol="grpc", upstream=("127.0.0.1", 8080))
    [ext] = [f for f in hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    patterns = [p["exact"] for p in ext["typed_config"]["allowed_headers"]["patterns"]]
    assert "x-team-key" in patterns and "x-api-key" not in patterns


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extauthz", "envoy-config", *argv], capture_output=True,
                          text=True, timeout=30, check=False)


def test_cli_prints_the_rendered_config_and_refuses_bad_flags() -> None:
    ok = cli("--policies", str(ROOT / "policies"), "--protocol", "http", "--upstream", "127.0.0.1:8080")
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout) == bootstrap(load_policy([ROOT / "policies"]), protocol="http",
                                                  upstream=("127.0.0.1", 8080))
    for argv, message in [
        (("--upstream", "nohostport"), "--upstream: HOST:PORT"),
        (("--upstream", "a:1", "--authz", "b:99999"), "--authz: HOST:PORT"),
        (("--upstream", "a:1", "--tls-ca", "ca.crt"), "go together"),
        (("--upstream", "a:1", "--listen-port", "0"), "--listen-port"),
    ]:
        bad = cli("--policies", str(ROOT / "policies"), "--protocol", "grpc", *argv)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    http_tls = cli("--policies", str(ROOT / "policies"), "--protocol", "http", "--upstream", "a:1",
                   "--tls-client-cert", "c", "--tls-client-key", "k", "--tls-ca", "ca")
    assert http_tls.returncode == 2 and "gRPC protocol only" in http_tls.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_rendered_config_runs_in_front_of_the_server(tmp_path: Path, protocol: str) -> None:
    (tmp_path / "api.yaml").write_text(RATE_ONLY)
    http_port = free_port()
    upstream = start_upstream()
    args = ["--http-listen", f"127.0.0.1:{http_port}"] if protocol == "http" else []
    server = ServerProcess([tmp_path], args=args)
    try:
        server.start()
        authz = ("127.0.0.1", server.port if protocol == "grpc" else http_port)
        config = bootstrap(load_policy([tmp_path]), protocol=protocol, upstream=("127.0.0.1", upstream.port),
                           authz=authz, listen_port=0, admin_port=0)
        with EnvoyProcess(yaml.safe_dump(config), concurrency=1) as envoy, HttpClient() as c:
            codes = [c.send(envoy.url + "/v1/x", headers={"x-api-key": "k"}).status for _ in range(3)]
            assert codes == [200, 200, 429]
            assert c.send(envoy.url + "/healthz").status == 200
    finally:
        server.stop()
        upstream.stop()
