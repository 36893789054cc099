"""The Envoy Gateway path through a real Envoy: envoy/envoy-gateway.yaml (the ext_authz filters,
per-route settings, route metadata, clusters and access log that Envoy Gateway generates from
helm/extauthz/examples/envoy-gateway/) in front of one server serving both protocols.

First that the file is what the examples make Envoy Gateway generate (field by field, from its
translator: see the file's header), then real decisions through it: allowed, 429, 503 (gRPC:
as answered; HTTP: 420 mapped by the EnvoyPatchPolicy), a tier from an HTTPRoute annotation,
a tier from a SecurityPolicy's contextExtensions, a limiter bucket per contextExtensions value,
the HTTP front door classifying on the client's path under Envoy Gateway's `path` prefix, and
leases released through the access log (gRPC: the answer's metadata; HTTP: the request-id
index)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient, Result
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy.config import GRPC_ACCESS_LOGGER
from extauthz.policy import load_policy
from testinfra.envoy_configs import config_path, validate

from ..conftest import ROOT
from .waits import GATEWAY_LIMITERS, held_request, live_leases, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = config_path("envoy-gateway.yaml")
EXAMPLES = ROOT / "helm" / "extauthz" / "examples" / "envoy-gateway"
EXT_AUTHZ = "envoy.filters.http.ext_authz"
EG_NAMESPACE = "envoy-gateway"
EG_PREFIX = "gateway.envoyproxy.io/"
GRPC_HOST, HTTP_HOST = "grpc.example.com", "http.example.com"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in ("gateway.yaml", "httproutes.yaml", "securitypolicy-grpc.yaml",
                 "securitypolicy-http.yaml", "envoypatchpolicy-503.yaml"):
        for d in docs(name):
            if d["kind"] == kind:
                out[d["metadata"]["name"]] = d
    return out


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    [listener] = config["static_resources"]["listeners"]
    [manager] = listener["default_filter_chain"]["filters"]
    typed: dict[str, Any] = manager["typed_config"]
    return typed


def json_patch_add(doc: dict[str, Any], pointer: str, value: Any) -> None:
    """RFC 6902 ``add`` (what EnvoyPatchPolicy's JSONPatch does to the listener's JSON)."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = copy.deepcopy(value)


def apply_patch_policy(config: dict[str, Any]) -> None:
    [policy] = by_kind("EnvoyPatchPolicy").values()
    listeners = {li["name"]: li for li in config["static_resources"]["listeners"]}
    for patch in policy["spec"]["jsonPatches"]:
        assert patch["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener"
        op = patch["operation"]
        assert op["op"] == "add"
        json_patch_add(listeners[patch["name"]], op["path"], op["value"])


def render(grpc_port: int, http_port: int, upstream: int, *, patch_503: bool = True) -> str:
    """The file with its clusters on loopback ports, the EnvoyPatchPolicy applied when asked;
    validated with ``envoy --mode validate``."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    for cluster in config["static_resources"]["clusters"]:
        name = cluster["name"]
        port = (upstream if name.startswith("httproute/")
                else http_port if name.startswith("securitypolicy/default/extauthz-http/") else grpc_port)
        [endpoints] = cluster["load_assignment"]["endpoints"]
        [lb] = endpoints["lb_endpoints"]
        lb["endpoint"]["address"]["socket_address"]["port_value"] = port
    if patch_503:
        apply_patch_policy(config)
    text = yaml.safe_dump(config, sort_keys=False)
    validate(text)
    return text


# -- the file is what the examples make Envoy Gateway generate -------------------------------------


def backend_cluster(policy: str, ref: dict[str, Any]) -> str:
    return f"securitypolicy/default/{policy}/{ref['namespace']}/{ref['name']}"


def matchers(names: list[str]) -> dict[str, Any]:
    return {"patterns": [{"exact": n, "ignore_case": True} for n in names]}


def test_filters_routes_and_clusters_are_what_envoy_gateway_generates() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    manager = hcm(config)
    filters = {f["name"]: f for f in manager["http_filters"]}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    routes = {r["name"]: r for vh in manager["route_config"]["virtual_hosts"] for r in vh["routes"]}
    policies = by_kind("SecurityPolicy")
    assert [f["name"] for f in manager["http_filters"]] == [
        *(f"{EXT_AUTHZ}/securitypolicy/default/{name}" for name in policies), "envoy.filters.http.router"]
    for name, policy in policies.items():
        spec = policy["spec"]["extAuth"]
        f = filters[f"{EXT_AUTHZ}/securitypolicy/default/{name}"]
        assert f["disabled"] is True  # enabled per route
        typed = f["typed_config"]
        assert typed["allowed_headers"] == matchers(spec["headersToExtAuth"])
        assert typed["failure_mode_allow"] is spec["failOpen"]
        assert typed["transport_api_version"] == "V3"
        assert ("route_metadata_context_namespaces" in typed) is bool(spec.get("includeRouteMetadata"))
        if spec.get("includeRouteMetadata"):
            assert typed["route_metadata_context_namespaces"] == [EG_NAMESPACE]
        timeout = f"{int(spec['timeout'].removesuffix('ms')) / 1000:.3f}s"
        if "grpc" in spec:
            [ref] = spec["grpc"]["backendRefs"]
            service = typed["grpc_service"]
            assert service == {"envoy_grpc": {"authority": f"{ref['name']}.{ref['namespace']}:{ref['port']}",
                                              "cluster_name": backend_cluster(name, ref)}, "timeout": timeout}
            assert set(typed) == {"@type", "allowed_headers", "failure_mode_allow", "grpc_service",
                                  "route_metadata_context_namespaces", "transport_api_version"}
            protocol = clusters[backend_cluster(name, ref)]["typed_extension_protocol_options"]
            assert "http2_protocol_options" in json.dumps(protocol)
        else:
            http = spec["http"]
            [ref] = http["backendRefs"]
            service = typed["http_service"]
            assert service == {
                "authorization_response": {"allowed_upstream_headers": matchers(http["headersToBackend"])},
                "path_prefix": http["path"],
                "server_uri": {"cluster": backend_cluster(name, ref), "timeout": timeout,
                               "uri": f"http://{ref['name']}.{ref['namespace']}:{ref['port']}{http['path']}"}}
            assert set(typed) == {"@type", "allowed_headers", "failure_mode_allow", "http_service",
                                  "transport_api_version"}
            assert "typed_extension_protocol_options" not in clusters[backend_cluster(name, ref)]
        assert clusters[backend_cluster(name, ref)]["connect_timeout"] == "10s"
        # every targeted HTTPRoute's routes enable this filter, with its context extensions
        extensions = {e["name"]: e["value"] for e in spec.get("contextExtensions", [])}
        for target in policy["spec"]["targetRefs"]:
            [route] = [r for n, r in routes.items() if n.startswith(f"httproute/default/{target['name']}/")]
            per_route = route["typed_per_filter_config"][f"{EXT_AUTHZ}/securitypolicy/default/{name}"]
            assert per_route["check_settings"] == ({"context_extensions": extensions} if extensions else {})

    # route metadata: the HTTPRoute, with its gateway.envoyproxy.io/ annotations, prefix removed
    for name, route in by_kind("HTTPRoute").items():
        [(route_name, generated)] = [(n, r) for n, r in routes.items() if n.startswith(f"httproute/default/{name}/")]
        [host] = route["spec"]["hostnames"]
        assert route_name == f"httproute/default/{name}/rule/0/match/0/{host.replace('.', '_')}"
        [resource] = generated["metadata"]["filter_metadata"][EG_NAMESPACE]["resources"]
        annotations = {k.removeprefix(EG_PREFIX): v for k, v in route["metadata"].get("annotations", {}).items()
                       if k.startswith(EG_PREFIX)}
        assert resource == {"kind": "HTTPRoute", "name": name, "namespace": "default",
                            **({"annotations": annotations} if annotations else {})}
        assert generated["route"]["cluster"] == f"httproute/default/{name}/rule/0"

    # the access log: EnvoyProxy's ALS sink, Envoy's default batching
    [proxy] = by_kind("EnvoyProxy").values()
    [setting] = proxy["spec"]["telemetry"]["accessLog"]["settings"]
    [sink] = setting["sinks"]
    [ref] = sink["als"]["backendRefs"]
    [logger] = manager["access_log"]
    assert logger["name"] == GRPC_ACCESS_LOGGER and sink["type"] == "ALS" and sink["als"]["type"] == "HTTP"
    als_cluster = f"accesslog/{ref['namespace']}/{ref['name']}/port/{ref['port']}"
    assert logger["typed_config"]["common_config"] == {
        "grpc_service": {"envoy_grpc": {"cluster_name": als_cluster}},
        "log_name": sink["als"]["logName"], "transport_api_version": "V3"}
    # the EnvoyPatchPolicy names this listener, and adds what the HTTP shape needs
    [patch_policy] = by_kind("EnvoyPatchPolicy").values()
    [gateway] = by_kind("Gateway").values()
    [patch] = patch_policy["spec"]["jsonPatches"]
    [listener] = gateway["spec"]["listeners"]
    assert patch["name"] == f"default/{gateway['metadata']['name']}/{listener['name']}"
    assert config["static_resources"]["listeners"][0]["name"] == patch["name"]
    assert "local_reply_config" not in manager
    apply_patch_policy(config)
    [mapper] = hcm(config)["local_reply_config"]["mappers"]
    assert mapper["status_code"] == 503


def test_example_values_policy_loads_and_reads_the_annotation(tmp_path: Path) -> None:
    values = yaml.safe_load((EXAMPLES / "values-envoy-gateway.yaml").read_text())
    (tmp_path / "api.yaml").write_text(values["policies"]["api.yaml"])
    policy = load_policy([tmp_path])
    assert yaml.safe_load(values["policies"]["api.yaml"])["classification"]["route_metadata"] == {
        "namespace": EG_NAMESPACE, "path": ["resources", 0, "annotations", "extauthz-tier"]}
    [prefix] = [e["value"] for e in values["extraEnv"] if e["name"] == "EXTAUTHZ_HTTP_PATH_PREFIX"]
    [http_policy] = [p for p in by_kind("SecurityPolicy").values() if "http" in p["spec"]["extAuth"]]
    assert prefix == http_policy["spec"]["extAuth"]["http"]["path"]
    # the SecurityPolicies send every header the policy reads
    for p in by_kind("SecurityPolicy").values():
        assert policy.needed_headers <= set(p["spec"]["extAuth"]["headersToExtAuth"])


# -- real decisions through it --------------------------------------------------------------------

#: the example's identity and classification, with limits small enough to reach
POLICY = """\
version: 1
identity:
  - header: x-api-key
test_mode:
  key_prefix: sk_test_
classification:
  route_metadata:
    namespace: envoy-gateway
    path: [resources, 0, annotations, extauthz-tier]
  rules:
    - match: {methods: [POST], path_prefix: /v1/charges}
      tier: critical
""" + GATEWAY_LIMITERS


@dataclass
class EgStack:
    upstream: Upstream
    server: ServerProcess
    envoy: EnvoyProcess

    def live_leases(self) -> dict[str, int]:
        return live_leases(self.server)

    def send(self, host: str, path: str, key: str, method: str = "GET", *, settle: bool = False) -> Result:
        """One request; ``settle``: first wait until the access log has released every lease
        (the fleet's non-critical share is one request)."""
        if settle:
            wait_for(lambda: self.live_leases() == {})
        with HttpClient() as c:
            return c.send(self.envoy.url + path, method=method, headers={"host": host, "x-api-key": key})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgStack]:
    policy = tmp_path_factory.mktemp("eg-policy")
    (policy / "api.yaml").write_text(POLICY)
    upstream = start_upstream()
    http_port = free_port()
    server = ServerProcess([policy], args=["--http-listen", f"127.0.0.1:{http_port}",
                                           "--http-path-prefix", "/authz"])
    envoy = None
    try:
        server.start()
        envoy = EnvoyProcess(render(server.port, http_port, upstream.port), concurrency=1).start()
        yield EgStack(upstream, server, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        server.stop()
        upstream.stop()


@pytest.mark.parametrize("host", [GRPC_HOST, HTTP_HOST])
def test_allowed_and_429(stack: EgStack, host: str) -> None:
    key = f"sk_live_rate_{host}"
    codes = [stack.send(host, "/rate/x", key).status for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    refused = stack.send(host, "/rate/x", key)
    assert refused.status == 429 and refused.limiter == "user-rate" and "retry-after" in refused.headers


def test_tiers_from_the_route_annotation_and_context_extensions(stack: EgStack) -> None:
    # GET /v1/charges: the rules make only POSTs critical; the HTTPRoute's annotation makes it so
    assert stack.send(GRPC_HOST, "/v1/charges/ch_1", "sk_live_t", settle=True).tier == "critical"
    # the batch route's SecurityPolicy says tier post in its contextExtensions (a GET would be get)
    assert stack.send(GRPC_HOST, "/v1/batch/jobs", "sk_live_t", settle=True).tier == "post"
    assert stack.send(GRPC_HOST, "/v1/customers", "sk_live_t", settle=True).tier == "get"
    assert stack.send(GRPC_HOST, "/v1/customers", "sk_test_t", settle=True).tier == "test"


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE", "PATCH", "OPTIONS"])
def test_http_front_door_classifies_on_the_clients_path_under_the_prefix(stack: EgStack, method: str) -> None:
    # Envoy sends the client's method and /authz + the client's path; the headersToBackend
    # tier says what the server decided: POST /v1/charges matched the rule on the client's path
    got = stack.send(HTTP_HOST, "/v1/charges", "sk_live_h", method=method, settle=True)
    assert got.status == 200
    assert got.tier == ("critical" if method == "POST" else "get" if method in ("GET", "OPTIONS") else "post")


@pytest.mark.parametrize(("host", "critical_path", "critical_method"), [
    (GRPC_HOST, "/v1/charges/ch_2", "GET"),   # critical by the HTTPRoute annotation
    (HTTP_HOST, "/v1/charges", "POST"),       # critical by the policy's rule, on the client's path
])
def test_503_for_non_critical_at_capacity_and_release_through_the_access_log(
        stack: EgStack, host: str, critical_path: str, critical_method: str) -> None:
    """fleet: capacity 2, half reserved for critical: one non-critical request in flight fills
    the non-critical share. The slow one's lease comes back through the access log."""
    wait_for(lambda: stack.live_leases() == {})
    with held_request(stack.envoy.url + "/v1/slow?delay=2", {"host": host, "x-api-key": "sk_live_slow"},
                      stack.server) as held:
        shed = stack.send(host, "/v1/customers", "sk_live_other")
        assert shed.status == 503 and shed.limiter == "fleet"  # HTTP: 420 mapped by the EnvoyPatchPolicy
        assert "retry-after" in shed.headers
        assert stack.send(host, critical_path, "sk_live_crit", method=critical_method).status == 200
        assert held.result(timeout=30) == 200
    # the access log ended the slow request's lease (its TTL is 60 s)
    wait_for(lambda: stack.live_leases() == {}, timeout=10)
    assert stack.send(host, "/v1/customers", "sk_live_other").status == 200
    wait_for(lambda: stack.live_leases() == {})



#: a bucket per team, the team named by the SecurityPolicy's contextExtensions
TEAM_POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - {name: team-rate, type: request_rate, rate: 0.001, burst: 2, key: [{context_extension: team}]}
"""


def test_context_extensions_key_a_bucket_per_team(tmp_path: Path) -> None:
    """extauthz-grpc (routes charges, api) says team payments, extauthz-grpc-batch (route batch)
    team batch: one user's requests fill each team's bucket on its own."""
    per_route = {r["name"].split("/")[2]: r["typed_per_filter_config"]
                 for vh in hcm(yaml.safe_load(CONFIG.read_text()))["route_config"]["virtual_hosts"]
                 for r in vh["routes"]}
    teams = {route: next(iter(c.values()))["check_settings"].get("context_extensions", {}).get("team")
             for route, c in per_route.items()}
    assert teams == {"charges": "payments", "api": "payments", "batch": "batch", "api-http": None}
    (tmp_path / "api.yaml").write_text(TEAM_POLICY)
    upstream = start_upstream()
    server = ServerProcess([tmp_path])
    try:
        server.start()
        with EnvoyProcess(render(server.port, free_port(), upstream.port, patch_503=False), concurrency=1) as envoy, \
                HttpClient() as c:
            def send(path: str, key: str = "sk_live_team") -> Result:
                return c.send(envoy.url + path, headers={"host": GRPC_HOST, "x-api-key": key})

            # payments: two routes, one bucket (whoever sends)
            assert [send("/v1/customers").status, send("/v1/charges/ch_1", "sk_live_other").status] == [200, 200]
            refused = send("/v1/customers")
            assert refused.status == 429 and refused.limiter == "team-rate"
            # batch: its own bucket, untouched by payments' requests, then full on its own
            assert [send("/v1/batch/jobs").status for _ in range(3)] == [200, 200, 429]
            assert send("/v1/charges/ch_2").status == 429  # payments' bucket is still empty
    finally:
        server.stop()
        upstream.stop()
