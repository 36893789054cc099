"""``extauthz envoy-config`` (extauthz/envoy/config.py): each shipped config is exactly the
output of the command line in its header (parsed YAML equal), every variant passes
``envoy --mode validate``, the access log appears only for a policy holding leases, and a
rendered config runs in front of the server with real decisions."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.devtools.client import HttpClient
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy.config import JwtProvider, TlsFiles, bootstrap, holds_leases, jwks_from_file, render
from extauthz.policy import load_policy
from testinfra.envoy_configs import validate

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

TLS_DIR = "/etc/envoy/extauthz-tls"
TLS = TlsFiles(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
#: every shipped config the generator renders (the others reproduce control planes: istio-like,
#: envoy-gateway, istio-waypoint)
SHIPPED = ("envoy.yaml", "envoy-http.yaml", "envoy-tls.yaml", "envoy-jwt.yaml", "envoy-ratelimit.yaml")
RATE_ONLY = ("version: 1\nidentity: [{header: x-api-key}]\n"
             "limiters:\n  - {name: r, type: request_rate, rate: 0.001, burst: 2}\n")


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return manager["typed_config"]  # type: ignore[no-any-return]


def command_line(text: str) -> list[str]:
    """The ``extauthz envoy-config`` command line in a shipped file's header comment
    (``\\``-continued over several comment lines), without ``extauthz envoy-config``."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("extauthz envoy-config "))
    words: list[str] = []
    for line in lines[start:]:
        words += shlex.split(line.removesuffix("\\"))
        if not line.endswith("\\"):
            break
    assert words[:2] == ["extauthz", "envoy-config"]
    return words[2:]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    assert main(["envoy-config", *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_exactly_the_output_of_its_command_line(
        name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "envoy" / name).read_text()
    monkeypatch.chdir(ROOT)  # the command lines name policies/ and envoy/ from the repository root
    assert run_cli(command_line(text), capsys) == yaml.safe_load(text)


def test_docs_give_each_shipped_command_line() -> None:
    commands, current = [], ""
    for line in (ROOT / "docs" / "envoy.md").read_text().splitlines():
        if current or line.startswith("extauthz envoy-config "):
            current += line.removesuffix("\\")
            if not line.endswith("\\"):
                commands.append(shlex.split(current)[2:])
                current = ""
    for name in SHIPPED:
        assert command_line((ROOT / "envoy" / name).read_text()) in commands, name


def variants() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for protocol in ("grpc", "http"):
        for access_log in ("auto", "always", "never", "fluentd"):
            out.append((f"{protocol}-{access_log}", {"protocol": protocol, "access_log": access_log}))
    out.append(("grpc-tls-names", {"protocol": "grpc", "tls": TLS, "authz": ("extauthz.extauthz", 9001),
                                   "upstream": ("api.default", 8080)}))
    out.append(("grpc-separate-log", {"protocol": "grpc", "access_log_to": ("127.0.0.1", 9101)}))
    out.append(("http-names", {"protocol": "http", "authz": ("extauthz.extauthz", 9003),
                               "access_log_to": ("extauthz.extauthz", 9001), "listen_port": 8000}))
    jwt = JwtProvider("https://issuer.example", ("a", "b"), jwks_from_file(str(ROOT / "envoy" / "jwt-demo-jwks.json")))
    for protocol in ("grpc", "http"):
        out.append((f"{protocol}-quickstart", {"protocol": protocol, "tracing": ("otel.observe", 4317),
                                               "quickstart_routes": True}))
        out.append((f"{protocol}-jwt", {"protocol": protocol, "jwt": jwt}))
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


@pytest.mark.parametrize(("label", "options"), variants(), ids=[v[0] for v in variants()])
def test_every_variant_refuses_underscores_and_strips_the_fail_open_mark_first(
        label: str, options: dict[str, Any]) -> None:
    manager = hcm(bootstrap(load_policy([ROOT / "policies"]), **{"upstream": ("127.0.0.1", 8080), **options}))
    assert manager["common_http_protocol_options"] == {"headers_with_underscores_action": "REJECT_REQUEST"}
    first = manager["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert {"remove": "x-envoy-auth-failure-mode-allowed"} in first


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


def test_access_log_fluentd_renders_envoy_s_fluentd_logger_to_the_fluentd_port(tmp_path: Path) -> None:
    from extauthz.envoy.records import FLUENTD_RECORD as RECORD
    from extauthz.envoy.records import FLUENTD_TAG as TAG

    (tmp_path / "api.yaml").write_text(RATE_ONLY)
    for protocol in ("grpc", "http"):
        # always (asked for by name), even for a policy without leases; never the gRPC logger
        config = bootstrap(load_policy([tmp_path]), protocol=protocol, upstream=("127.0.0.1", 8080),
                           authz=("extauthz.extauthz", 9003), access_log="fluentd")
        (log,) = hcm(config)["access_log"]
        assert log["name"] == "envoy.access_loggers.fluentd"
        assert log["typed_config"]["record"] == RECORD and log["typed_config"]["tag"] == TAG
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == log["typed_config"]["cluster"]]
        assert "typed_extension_protocol_options" not in cluster  # plain TCP, not HTTP/2
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert endpoint["socket_address"] == {"address": "extauthz.extauthz", "port_value": 9004}
        names = [c["name"] for c in config["static_resources"]["clusters"]]
        assert "extauthz_access_log" not in names


def test_allowed_headers_follow_the_policy(tmp_path: Path) -> None:
    (tmp_path / "api.yaml").write_text(RATE_ONLY.replace("x-api-key", "x-team-key"))
    config = bootstrap(load_policy([tmp_path]), protocol="grpc", upstream=("127.0.0.1", 8080))
    [ext] = [f for f in hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    patterns = [p["exact"] for p in ext["typed_config"]["allowed_headers"]["patterns"]]
    assert "x-team-key" in patterns and "x-api-key" not in patterns


def test_the_access_log_never_carries_a_header_that_may_hold_a_credential(tmp_path: Path) -> None:
    """Issue 29 review: every header a tier rule reads went into the access log's
    ``additional_request_headers_to_log``; a rule on the API key's header sent every client's
    raw key to the log. Identity, plan and key-part headers and the credential headers are
    never logged (such a rule then never matches an unchecked request's entry)."""
    rules = "".join(f"    - {{match: {{headers: {{{h}: x}}}}, tier: critical}}\n" for h in (
        "X-Api-Key", "authorization", "Cookie", "proxy-authorization", "x-plan", "x-org", "x-client-class"))
    (tmp_path / "api.yaml").write_text(
        "version: 1\nidentity: [{header: X-Api-Key}]\nplan: {from: [{header: x-plan}], default: free}\n"
        f"test_mode: {{header: x-test}}\nclassification:\n  rules:\n{rules}"
        "limiters:\n  - {name: c, type: concurrent_requests, limit: 5, key: [{header: X-Org}, {method: true}]}\n")
    policy = load_policy([tmp_path])
    for protocol in ("grpc", "http"):
        config = bootstrap(policy, protocol=protocol, upstream=("127.0.0.1", 8080))
        (log,) = hcm(config)["access_log"]
        logged = log["typed_config"]["additional_request_headers_to_log"]
        assert logged == ["x-envoy-auth-failure-mode-allowed", "x-client-class", "x-test"]


def authz_timeouts(config: dict[str, Any]) -> list[str]:
    """The ext_authz filter's timeout (gRPC: grpc_service; HTTP: http_service.server_uri), or
    the ratelimit filter's (--protocol ratelimit)."""
    filters = {f["name"]: f["typed_config"] for f in hcm(config)["http_filters"]}
    if "envoy.filters.http.ext_authz" not in filters:
        return [filters["envoy.filters.http.ratelimit"]["timeout"]]
    ext = filters["envoy.filters.http.ext_authz"]
    service = ext.get("grpc_service") or ext["http_service"]["server_uri"]
    return [service["timeout"]]


def test_envoy_s_timeout_is_the_server_s_check_budget_plus_the_margin(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The server decides within --check-budget-ms (extauthz/engine/overload.py); Envoy waits that
    plus 50 ms before it fails the check open, whether the budget is given as serve's flag or
    its variable, and the shipped configs carry the default's (200 ms: 0.25 s)."""
    base = ["--policies", str(ROOT / "policies"), "--upstream", "127.0.0.1:8080"]
    for protocol in ("grpc", "http"):
        assert authz_timeouts(run_cli([*base, "--protocol", protocol], capsys)) == ["0.25s"]
        assert authz_timeouts(run_cli([*base, "--protocol", protocol, "--check-budget-ms", "950"],
                                      capsys)) == ["1s"]
        monkeypatch.setenv("EXTAUTHZ_CHECK_BUDGET_MS", "120")
        assert authz_timeouts(run_cli([*base, "--protocol", protocol], capsys)) == ["0.17s"]
        monkeypatch.delenv("EXTAUTHZ_CHECK_BUDGET_MS")
    for name in SHIPPED:
        assert authz_timeouts(yaml.safe_load((ROOT / "envoy" / name).read_text())) == ["0.25s"], name
    bad = cli(*base, "--protocol", "grpc", "--check-budget-ms", "nan")
    assert bad.returncode == 2 and "--check-budget-ms" in bad.stderr and "finite" in bad.stderr
    bad = cli(*base, "--protocol", "grpc", "--check-budget-ms", "600000")
    assert bad.returncode == 2 and "at most 60000" in bad.stderr


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
    jwks = ROOT / "envoy" / "jwt-demo-jwks.json"
    for argv, message in [
        (("--jwt-issuer", "https://i"), "--jwt-issuer and --jwt-jwks-file go together"),
        (("--jwt-jwks-file", str(jwks)), "--jwt-issuer and --jwt-jwks-file go together"),
        (("--jwt-audience", "a"), "--jwt-audience needs them"),
        (("--jwt-issuer", "https://i", "--jwt-jwks-file", "/nonexistent/jwks.json"), "cannot read /nonexistent"),
        (("--jwt-issuer", "https://i", "--jwt-jwks-file", str(ROOT / "policies" / "api.yaml")), "is not JSON"),
        (("--jwt-issuer", "https://i", "--jwt-jwks-file", str(ROOT / "pyproject.toml")), "is not JSON"),
        (("--tracing", "collector"), "--tracing: HOST:PORT"),
    ]:
        bad = cli("--policies", str(ROOT / "policies"), "--protocol", "grpc", "--upstream", "a:1", *argv)
        assert bad.returncode == 2 and message in bad.stderr, (argv, bad.stderr)
    http_tls = cli("--policies", str(ROOT / "policies"), "--protocol", "http", "--upstream", "a:1",
                   "--tls-client-cert", "c", "--tls-client-key", "k", "--tls-ca", "ca")
    assert http_tls.returncode == 2 and "gRPC protocol only" in http_tls.stderr


def test_quickstart_routes_put_the_tier_where_the_policy_reads_it(tmp_path: Path) -> None:
    def routes(classification: str) -> dict[str, Any]:
        (tmp_path / "api.yaml").write_text(RATE_ONLY + classification)
        config = bootstrap(load_policy([tmp_path]), protocol="grpc", upstream=("127.0.0.1", 8080),
                           quickstart_routes=True)
        return {r["name"]: r for r in hcm(config)["route_config"]["virtual_hosts"][0]["routes"]}

    nested = routes("classification: {route_metadata: {namespace: team, path: [limits, tier]}}\n")
    assert nested["reports"]["metadata"] == {"filter_metadata": {"team": {"limits": {"tier": "get"}}}}
    with pytest.raises(ValueError, match="list index"):
        routes("classification: {route_metadata: {namespace: envoy-gateway, "
               "path: [resources, 0, annotations, extauthz-tier]}}\n")


def test_jwks_file_must_hold_keys(tmp_path: Path) -> None:
    for text in ('{"keys": []}', '[1]', '{"key": [{}]}'):
        (tmp_path / "jwks.json").write_text(text)
        with pytest.raises(ValueError, match="is not a JWKS"):
            jwks_from_file(str(tmp_path / "jwks.json"))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_jwt_payload_reaches_the_server_the_protocol_s_way(protocol: str) -> None:
    jwt = JwtProvider("https://issuer.example", (), '{"keys": [{"kty": "oct"}]}')
    filters = hcm(bootstrap(load_policy([ROOT / "policies"]), protocol=protocol, upstream=("127.0.0.1", 8080),
                            jwt=jwt))["http_filters"]
    names = [f["name"] for f in filters]
    # after the filter stripping client copies, before ext_authz (and the route tier, on HTTP)
    assert names[1] == "envoy.filters.http.jwt_authn" and names[-2] == "envoy.filters.http.ext_authz"
    provider = filters[1]["typed_config"]["providers"]["issuer"]
    assert "audiences" not in provider and provider["payload_in_metadata"] == "payload"
    ext = filters[-2]["typed_config"]
    if protocol == "grpc":
        assert ext["metadata_context_namespaces"] == ["envoy.filters.http.jwt_authn"]
    else:  # no metadata on the HTTP protocol: the header the strip filter removed from the client
        assert provider["forward_payload_header"] == "x-jwt-payload"
        assert "x-jwt-payload" in [r["remove"] for r in filters[0]["typed_config"]["mutations"]["request_mutations"]]


@contextmanager
def in_front_of_the_server(tmp_path: Path, protocol: str) -> Iterator[tuple[ServerProcess, Upstream, EnvoyProcess]]:
    """A server on ``protocol`` with the RATE_ONLY policy, an upstream, and Envoy running the
    config ``bootstrap`` renders for them."""
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
        with EnvoyProcess(yaml.safe_dump(config), concurrency=1) as envoy:
            yield server, upstream, envoy
    finally:
        server.stop()
        upstream.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_rendered_config_runs_in_front_of_the_server(tmp_path: Path, protocol: str) -> None:
    with in_front_of_the_server(tmp_path, protocol) as (_, _, envoy), HttpClient() as c:
        codes = [c.send(envoy.url + "/v1/x", headers={"x-api-key": "k"}).status for _ in range(3)]
        assert codes == [200, 200, 429]
        assert c.send(envoy.url + "/healthz").status == 200


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_underscored_headers_are_refused_and_only_envoy_marks_a_fail_open(tmp_path: Path, protocol: str) -> None:
    """An upstream that folds ``_`` into ``-`` (CGI, WSGI) would read ``x_api_key`` as the
    API key the policy never counted: Envoy refuses the request (400) before any filter runs.
    A client's ``x-envoy-auth-failure-mode-allowed`` is removed before ext_authz, so the
    upstream sees that header only when Envoy itself let a check fail open."""
    with in_front_of_the_server(tmp_path, protocol) as (server, upstream, envoy), HttpClient() as c:
        refused = c.send(envoy.url + "/v1/x", headers={"x-api-key": "k1", "x_api_key": "k2"})
        assert refused.status == 400  # Envoy's own answer: the upstream echoes with a 200
        assert upstream.served == 0
        forged = c.send(envoy.url + "/v1/x", headers={"x-api-key": "k1",
                                                      "x-envoy-auth-failure-mode-allowed": "true"})
        assert forged.status == 200
        assert "x-envoy-auth-failure-mode-allowed" not in json.loads(forged.body)["headers"]
        server.stop()  # now every check fails open, and Envoy says so itself
        unchecked = c.send(envoy.url + "/v1/x", headers={"x-api-key": "k1"})
        assert unchecked.status == 200
        assert json.loads(unchecked.body)["headers"]["x-envoy-auth-failure-mode-allowed"] == "true"
