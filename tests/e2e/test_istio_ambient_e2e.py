"""The Istio ambient path through a real Envoy: envoy/istio-waypoint.yaml (the per-service HTTP
chain istiod gives a waypoint proxy for a CUSTOM AuthorizationPolicy with targetRefs to it, and
the Telemetry access logger) in front of the server.

First that the file is what istiod generates from examples/istio-ambient/ and the mesh-config
providers of examples/istio/, then real decisions: allowed, 429, 503 for a non-critical request
at fleet capacity (gRPC carries it), a path outside the policy's rules never checked, and the
held lease released through the access log long before its TTL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient, Result
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy.config import EXT_AUTHZ_FILTER, GRPC_ACCESS_LOGGER
from testinfra.envoy_configs import config_path, validate

from ..conftest import ROOT
from .istio_like import hcm
from .waits import GATEWAY_LIMITERS, held_request, live_leases, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = config_path("istio-waypoint.yaml")
AMBIENT = ROOT / "helm" / "extauthz" / "examples" / "istio-ambient"
ISTIO = ROOT / "helm" / "extauthz" / "examples" / "istio"
API_CLUSTER = "inbound-vip|8080|http|api.default.svc.cluster.local"


def doc(directory: Any, name: str, kind: str) -> dict[str, Any]:
    [found] = [d for d in yaml.safe_load_all((directory / name).read_text()) if d and d["kind"] == kind]
    return found  # type: ignore[no-any-return]


def test_config_is_the_waypoint_chain_istiod_generates() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    manager = hcm(config)
    mesh = yaml.safe_load((ISTIO / "meshconfig.yaml").read_text())
    providers = {p["name"]: p for p in mesh["meshConfig"]["extensionProviders"]}
    policy = doc(AMBIENT, "authorizationpolicy.yaml", "AuthorizationPolicy")
    waypoint = doc(AMBIENT, "waypoint.yaml", "Gateway")
    telemetry = doc(AMBIENT, "telemetry.yaml", "Telemetry")
    target = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": waypoint["metadata"]["name"]}
    # bound to the waypoint (not a workload selector: ztunnel cannot run ext_authz)
    assert policy["spec"]["targetRefs"] == [target] and "selector" not in policy["spec"]
    assert telemetry["spec"]["targetRefs"] == [target]
    assert policy["metadata"]["namespace"] == waypoint["metadata"]["namespace"]
    assert waypoint["spec"]["gatewayClassName"] == "istio-waypoint"
    assert policy["spec"]["action"] == "CUSTOM"
    provider = policy["spec"]["provider"]["name"]
    grpc_provider = providers[provider]["envoyExtAuthzGrpc"]

    # the CUSTOM builder's filters first, then the router
    rbac, ext_authz, router = manager["http_filters"]
    assert (rbac["name"], ext_authz["name"], router["name"]) == (
        "envoy.filters.http.rbac", EXT_AUTHZ_FILTER, "envoy.filters.http.router")
    assert manager["use_remote_address"] is False
    assert manager["normalize_path"] is True and "merge_slashes" not in manager
    meta = policy["metadata"]
    [(name, generated)] = rbac["typed_config"]["shadow_rules"]["policies"].items()
    assert name == f"istio-ext-authz-{provider}-ns[{meta['namespace']}]-policy[{meta['name']}]-rule[0]"
    [[operation]] = [[to["operation"] for to in rule["to"]] for rule in policy["spec"]["rules"]]
    [permission] = generated["permissions"]
    [not_rule] = permission["and_rules"]["rules"]
    assert [r["url_path"]["path"]["exact"] for r in not_rule["not_rule"]["or_rules"]["rules"]] == operation["notPaths"]
    authz = ext_authz["typed_config"]
    cluster = f"outbound|{grpc_provider['port']}||{grpc_provider['service']}"
    assert authz["grpc_service"]["envoy_grpc"] == {"cluster_name": cluster, "authority": grpc_provider["service"]}
    assert authz["grpc_service"]["timeout"] == grpc_provider["timeout"]
    assert authz["failure_mode_allow"] is grpc_provider["failOpen"]
    assert authz["filter_enabled_metadata"]["value"]["string_match"] == {"prefix": f"istio-ext-authz-{provider}"}

    # the per-service route config and the Telemetry's logger
    route_config = manager["route_config"]
    assert route_config["name"] == API_CLUSTER
    [vhost] = route_config["virtual_hosts"]
    assert vhost["name"] == "inbound|http|8080"
    [logger] = manager["access_log"]
    [[als]] = [[p["name"] for p in a["providers"] if p["name"] in providers]
               for a in telemetry["spec"]["accessLogging"]]
    als_provider = providers[als]["envoyHttpAls"]
    common = logger["typed_config"]["common_config"]
    assert logger["name"] == GRPC_ACCESS_LOGGER and common["log_name"] == als_provider["logName"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == (
        f"outbound|{als_provider['port']}||{als_provider['service']}")


POLICY = """\
version: 1
identity:
  - header: x-api-key
classification:
  rules:
    - match: {methods: [POST], path_prefix: /v1/charges}
      tier: critical
""" + GATEWAY_LIMITERS


class Waypoint:
    def __init__(self, upstream: Upstream, server: ServerProcess, envoy: EnvoyProcess) -> None:
        self.upstream, self.server, self.envoy = upstream, server, envoy

    def live_leases(self) -> dict[str, int]:
        return live_leases(self.server)

    def send(self, path: str, key: str, method: str = "GET") -> Result:
        with HttpClient() as c:
            return c.send(self.envoy.url + path, method=method, headers={"x-api-key": key})

    def checks(self) -> int:
        return sum(self.envoy.stats(r"ext_authz\.ok$|ext_authz\.denied$").values())


@pytest.fixture(scope="module")
def waypoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Waypoint]:
    policy = tmp_path_factory.mktemp("waypoint-policy")
    (policy / "api.yaml").write_text(POLICY)
    upstream = start_upstream()
    server = ServerProcess([policy])
    envoy = None
    try:
        server.start()
        config = yaml.safe_load(CONFIG.read_text())
        for cluster in config["static_resources"]["clusters"]:
            port = upstream.port if cluster["name"] == API_CLUSTER else server.port
            [endpoints] = cluster["load_assignment"]["endpoints"]
            [lb] = endpoints["lb_endpoints"]
            lb["endpoint"]["address"]["socket_address"]["port_value"] = port
        text = yaml.safe_dump(config, sort_keys=False)
        validate(text)
        envoy = EnvoyProcess(text, concurrency=1).start()
        yield Waypoint(upstream, server, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        server.stop()
        upstream.stop()


def test_allowed_429_and_health_checks_unchecked(waypoint: Waypoint) -> None:
    assert [waypoint.send("/rate/x", "sk_live_w").status for _ in range(4)] == [200, 200, 200, 429]
    refused = waypoint.send("/rate/x", "sk_live_w")
    assert refused.status == 429 and refused.limiter == "user-rate"
    before = waypoint.checks()
    assert before >= 5  # the counter is read (the requests above were checked)
    assert waypoint.send("/healthz", "sk_live_w").status == 200  # notPaths: no Check call
    assert waypoint.checks() == before


def test_503_at_fleet_capacity_and_release_through_the_access_log(waypoint: Waypoint) -> None:
    wait_for(lambda: waypoint.live_leases() == {})
    with held_request(waypoint.envoy.url + "/v1/slow?delay=2", {"x-api-key": "sk_live_slow"},
                      waypoint.server) as held:
        shed = waypoint.send("/v1/customers", "sk_live_other")
        assert shed.status == 503 and shed.limiter == "fleet" and "retry-after" in shed.headers
        critical = waypoint.send("/v1/charges", "sk_live_crit", method="POST")
        assert critical.status == 200 and critical.tier == "critical"
        assert held.result(timeout=30) == 200
    wait_for(lambda: waypoint.live_leases() == {}, timeout=10)  # the access log, not the 60 s TTL
    assert waypoint.send("/v1/customers", "sk_live_other").status == 200
