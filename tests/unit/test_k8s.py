"""``extauthz k8s``: the shipped examples under helm/extauthz/examples/ are its output (compared
as parsed YAML, so their comments stay), its header lists are ``envoy-allowed-headers``', and
its options fail with a clear message. The Envoy each example implies runs in
tests/e2e/test_envoy_gateway_e2e.py, test_istio_e2e.py and test_istio_ambient_e2e.py, which read
these same files."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.commands.k8s import Wiring, headers_to_check, resources
from extauthz.envoy.headers import allowed_headers
from extauthz.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "helm" / "extauthz" / "examples"
EG_VALUES = EXAMPLES / "envoy-gateway" / "values-envoy-gateway.yaml"
ISTIO_VALUES = EXAMPLES / "istio" / "values-istio.yaml"
GATEWAY = ["--namespace", "istio-system", "--selector", "istio=ingressgateway",
           "--skip-path", "/healthz", "--skip-path", "/readyz"]

#: (the values file whose policy is POLICY_DIR, the command's options, the example files)
CASES: list[tuple[Path, list[str], list[str]]] = [
    (EG_VALUES, ["--target", "envoy-gateway", "--name", "extauthz-grpc", "--target-ref", "HTTPRoute/charges",
                 "--target-ref", "HTTPRoute/api", "--context-extension", "team=payments"],
     ["envoy-gateway/securitypolicy-grpc.yaml", "envoy-gateway/gateway.yaml"]),
    (EG_VALUES, ["--target", "envoy-gateway", "--name", "extauthz-grpc-batch", "--target-ref", "HTTPRoute/batch",
                 "--context-extension", "tier=post", "--context-extension", "team=batch"],
     ["envoy-gateway/securitypolicy-grpc.yaml", "envoy-gateway/gateway.yaml"]),
    (EG_VALUES, ["--target", "envoy-gateway", "--protocol", "http", "--name", "extauthz-http",
                 "--target-ref", "HTTPRoute/api-http", "--http-path", "/authz"],
     ["envoy-gateway/securitypolicy-http.yaml", "envoy-gateway/gateway.yaml"]),
    (ISTIO_VALUES, ["--target", "istio-sidecar", *GATEWAY],
     ["istio/meshconfig.yaml", "istio/authorizationpolicy.yaml", "istio/telemetry.yaml"]),
    (ISTIO_VALUES, ["--target", "istio-sidecar", "--protocol", "http", *GATEWAY],
     ["istio/meshconfig-http.yaml", "istio/authorizationpolicy.yaml", "istio/telemetry.yaml"]),
    (ISTIO_VALUES, ["--target", "istio-sidecar", "--selector", "app=api"],
     ["istio/meshconfig.yaml", "istio-sidecar/authorizationpolicy.yaml", "istio-sidecar/telemetry.yaml"]),
    (ISTIO_VALUES, ["--target", "istio-ambient", "--name", "extauthz-waypoint", "--target-ref", "Gateway/waypoint",
                    "--skip-path", "/healthz", "--skip-path", "/readyz"],
     ["istio/meshconfig.yaml", "istio-ambient/authorizationpolicy.yaml", "istio-ambient/telemetry.yaml"]),
]
#: what the generator writes (the mesh-config fragment has no kind)
GENERATED = {"SecurityPolicy", "EnvoyProxy", "ReferenceGrant", "AuthorizationPolicy", "Telemetry", "meshConfig"}


def policy_dir(values: Path, tmp_path: Path) -> Path:
    directory = tmp_path / values.stem
    directory.mkdir(exist_ok=True)
    (directory / "api.yaml").write_text(yaml.safe_load(values.read_text())["policies"]["api.yaml"])
    return directory


def ident(doc: dict[str, Any]) -> tuple[str, str]:
    if "meshConfig" in doc:
        return ("meshConfig", "")
    return (doc.get("kind", ""), doc.get("metadata", {}).get("name", ""))  # values files have no kind


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def shipped(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return {ident(d): d for d in docs if ident(d)[0] in GENERATED}


@pytest.mark.parametrize(("values", "options", "files"), CASES, ids=[" ".join(c[1][:4]) for c in CASES])
def test_shipped_examples_are_the_generators_output(values: Path, options: list[str], files: list[str],
                                                    tmp_path: Path) -> None:
    code, out, err = run(["k8s", *options, "--policies", str(policy_dir(values, tmp_path))])
    assert (code, err) == (0, "")
    generated = {ident(d): d for d in yaml.safe_load_all(out) if d}
    examples: dict[tuple[str, str], dict[str, Any]] = {}
    for name in files:
        examples |= shipped(name)
    assert set(generated) <= set(examples), f"generated but not shipped: {set(generated) - set(examples)}"
    for key, doc in generated.items():
        assert examples[key] == doc, key


def test_every_generated_kind_in_the_examples_is_covered(tmp_path: Path) -> None:
    """No hand-written SecurityPolicy, AuthorizationPolicy, Telemetry... left beside the generated ones."""
    covered = set()
    for values, options, files in CASES:
        _, out, _ = run(["k8s", *options, "--policies", str(policy_dir(values, tmp_path))])
        covered |= {(f, ident(d)) for f in files for d in yaml.safe_load_all(out) if d and ident(d) in shipped(f)}
    every = {(str(p.relative_to(EXAMPLES)), key) for p in EXAMPLES.glob("*/*.yaml") for key in shipped(
        str(p.relative_to(EXAMPLES)))}
    assert every == covered


def test_header_lists_are_envoy_allowed_headers(tmp_path: Path) -> None:
    policy = load_policy([policy_dir(ISTIO_VALUES, tmp_path)])
    grpc = Wiring(target="envoy-gateway", target_refs=(("HTTPRoute", "api"),))
    assert headers_to_check(policy, grpc) == allowed_headers(policy.needed_headers, "grpc")
    http = Wiring(target="istio-sidecar", protocol="http", selector=(("app", "api"),))
    assert headers_to_check(policy, http) == [h for h in allowed_headers(policy.needed_headers, "http")
                                              if h != "x-extauthz-route-tier"]
    # Envoy Gateway: never the JWT payload header (nothing there verifies it or removes a client's copy)
    eg_http = Wiring(target="envoy-gateway", protocol="http", target_refs=(("HTTPRoute", "api"),))
    assert "x-jwt-payload" not in headers_to_check(policy, eg_http)
    assert "x-jwt-payload" in headers_to_check(policy, http)


def test_route_metadata_and_leases_decide_what_is_written(tmp_path: Path) -> None:
    """includeRouteMetadata only where the policy reads Envoy Gateway's route metadata; the
    access log (EnvoyProxy, extauthz-als, Telemetry) only where it holds leases; no
    ReferenceGrant when the server is in the routes' namespace."""
    (tmp_path / "p.yaml").write_text("version: 1\nidentity: [{header: x-user}]\n"
                                     "limiters: [{name: r, type: request_rate, rate: 5, burst: 5}]\n")
    policy = load_policy([tmp_path / "p.yaml"])
    same = Wiring(target="envoy-gateway", target_refs=(("Gateway", "eg"),), service_namespace="default")
    [(_, security)] = resources(policy, same)
    assert "includeRouteMetadata" not in security["spec"]["extAuth"]
    assert security["spec"]["extAuth"]["headersToExtAuth"] == ["x-user", "x-request-id"]
    ambient = [d for _, d in resources(policy, Wiring(target="istio-ambient"))]
    assert [ident(d)[0] for d in ambient] == ["meshConfig", "AuthorizationPolicy"]
    assert [p["name"] for p in ambient[0]["meshConfig"]["extensionProviders"]] == ["extauthz"]
    assert ambient[1]["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}]


@pytest.mark.parametrize(("options", "message"), [
    (["--target", "envoy-gateway"], "--target-ref: envoy-gateway needs the HTTPRoute(s) or Gateway to protect"),
    (["--target", "istio-ambient", "--selector", "app=api"], "--selector: a selector binds the policy to ztunnel"),
    (["--target", "istio-sidecar"], "istio-sidecar: --selector KEY=VALUE (the workloads) or --target-ref"),
    (["--target", "envoy-gateway", "--target-ref", "api"], "--target-ref: KIND/NAME, not 'api'"),
    (["--target", "envoy-gateway", "--protocol", "http", "--target-ref", "HTTPRoute/a",
      "--context-extension", "tier=post"], "--context-extension: gRPC only"),
    (["--target", "istio-sidecar", "--selector", "app=api", "--port", "70000"], "--port: 1-65535, not 70000"),
])
def test_bad_options_exit_2_with_the_reason(options: list[str], message: str, tmp_path: Path) -> None:
    code, out, err = run(["k8s", *options, "--policies", str(policy_dir(ISTIO_VALUES, tmp_path))])
    assert (code, out) == (2, "")
    assert err.startswith(f"extauthz k8s: {message}")


def _docs(tmp_path: Path, *options: str) -> dict[str, dict[str, Any]]:
    code, out, err = run(["k8s", *options, "--policies", str(policy_dir(ISTIO_VALUES, tmp_path))])
    assert code == 0, err
    return {ident(d)[0]: d for d in yaml.safe_load_all(out) if d}


def test_no_path_is_exempt_unless_asked(tmp_path: Path) -> None:
    """The AuthorizationPolicy's notPaths applies to every pod it covers: /healthz and /readyz
    of the applications went unchecked (never limited). Now one empty rule (every request) by
    default, notPaths only from --skip-path; Envoy Gateway refuses --skip-path."""
    for target in (["--target", "istio-sidecar", "--selector", "app=api"], ["--target", "istio-ambient"]):
        assert _docs(tmp_path, *target)["AuthorizationPolicy"]["spec"]["rules"] == [{}]
    skipping = _docs(tmp_path, "--target", "istio-ambient", "--skip-path", "/livez")
    rules = skipping["AuthorizationPolicy"]["spec"]["rules"]
    assert rules == [{"to": [{"operation": {"notPaths": ["/livez"]}}]}]
    code, _, err = run(["k8s", "--target", "envoy-gateway", "--target-ref", "HTTPRoute/a", "--skip-path", "/healthz",
                        "--policies", str(policy_dir(ISTIO_VALUES, tmp_path))])
    assert code == 2 and "--skip-path: Istio only" in err
    code, _, err = run(["k8s", "--target", "istio-ambient", "--skip-path", "healthz",
                        "--policies", str(policy_dir(ISTIO_VALUES, tmp_path))])
    assert code == 2 and "--skip-path: a path starting with /" in err


def test_http_path_on_istio_is_the_providers_path_prefix(tmp_path: Path) -> None:
    """Istio's envoyExtAuthzHttp has pathPrefix (istio/api mesh/v1alpha1/config.proto): the
    server's --http-path-prefix can be used behind Istio too (it was refused)."""
    mesh = _docs(tmp_path, "--target", "istio-sidecar", "--selector", "app=api", "--protocol", "http",
                 "--http-path", "/authz")["meshConfig"]
    assert mesh["meshConfig"]["extensionProviders"][0]["envoyExtAuthzHttp"]["pathPrefix"] == "/authz"
    code, _, err = run(["k8s", "--target", "istio-sidecar", "--selector", "app=api", "--http-path", "/authz",
                        "--policies", str(policy_dir(ISTIO_VALUES, tmp_path))])
    assert code == 2 and "--http-path: a path starting with / (HTTP protocol only)" in err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_fail_closed_is_a_choice_with_one_error_status(tmp_path: Path, protocol: str) -> None:
    """Fail-open was hard-coded, with statusOnError on Istio gRPC only. --fail-closed sets
    failOpen false everywhere, and the status on error is 503 on every provider."""
    eg = ["--target", "envoy-gateway", "--target-ref", "HTTPRoute/a", "--protocol", protocol]
    sidecar = ["--target", "istio-sidecar", "--selector", "app=api", "--protocol", protocol]
    kind = "envoyExtAuthzGrpc" if protocol == "grpc" else "envoyExtAuthzHttp"
    for closed in (False, True):
        extra = ["--fail-closed"] if closed else []
        ext = _docs(tmp_path, *eg, *extra)["SecurityPolicy"]["spec"]["extAuth"]
        assert ext["failOpen"] is not closed
        assert ext.get("statusOnError") == (503 if closed else None)  # Envoy Gateway >= v1.8.0 only
        provider = _docs(tmp_path, *sidecar, *extra)["meshConfig"]["meshConfig"]["extensionProviders"][0][kind]
        assert (provider["failOpen"], provider["statusOnError"]) == (not closed, "503")
