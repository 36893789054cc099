"""The Istio and Envoy Gateway shapes that point Envoy's ratelimit filter at the server
(helm/extauthz/examples/istio/envoyfilter-ratelimit.yaml, examples/envoy-gateway/
envoypatchpolicy-ratelimit.yaml) applied to the configs istiod and Envoy Gateway generate
(envoy/istio-like.yaml, envoy/envoy-gateway.yaml), as their patch operations do: each passes
``envoy --mode validate``, and the Istio one answers through a real Envoy with the shipped
rate limit policy (policies/ratelimit/)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.core.clock import ManualClock
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import free_port
from extauthz.devtools.upstream import start_upstream
from extauthz.envoy.ratelimit import RATELIMIT_FILTER, rate_limits
from extauthz.policy import load_policy
from extauthz.server.app import Server, ServerConfig
from testinfra.envoy_configs import config_path, validate

from ..conftest import ROOT
from . import istio_like
from .test_ratelimit_e2e import START, get

pytestmark = pytest.mark.e2e

EXAMPLES = ROOT / "helm" / "extauthz" / "examples"
ROUTER = "envoy.filters.http.router"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def apply_envoyfilters(config: dict[str, Any]) -> None:
    """The two EnvoyFilters' patches, as istiod applies them to the gateway's listener:
    HTTP_FILTER INSERT_BEFORE the router, VIRTUAL_HOST MERGE (every virtual host: name "")."""
    manager = istio_like.hcm(config)
    for doc in docs(EXAMPLES / "istio" / "envoyfilter-ratelimit.yaml"):
        assert doc["kind"] == "EnvoyFilter"
        for patch in doc["spec"]["configPatches"]:
            value = copy.deepcopy(patch["patch"]["value"])
            if patch["applyTo"] == "HTTP_FILTER":
                assert patch["patch"]["operation"] == "INSERT_BEFORE"
                assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER
                filters = manager["http_filters"]
                filters.insert([f["name"] for f in filters].index(ROUTER), value)
            else:
                assert (patch["applyTo"], patch["patch"]["operation"]) == ("VIRTUAL_HOST", "MERGE")
                assert patch["match"]["routeConfiguration"]["vhost"]["name"] == ""
                for vhost in manager["route_config"]["virtual_hosts"]:
                    vhost.setdefault("rate_limits", []).extend(value["rate_limits"])


def istio_config(extauthz: int, upstream: int) -> str:
    config = yaml.safe_load(istio_like.render([extauthz], upstream))
    apply_envoyfilters(config)
    manager = istio_like.hcm(config)
    names = [f["name"] for f in manager["http_filters"]]
    assert names[-2:] == [RATELIMIT_FILTER, ROUTER] and "envoy.filters.http.ext_authz" in names
    rls = manager["http_filters"][-2]["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]
    assert rls["cluster_name"] == istio_like.EXTAUTHZ_CLUSTER  # the Service's cluster istiod makes
    text = yaml.safe_dump(config, sort_keys=False)
    validate(text)
    return text


def test_both_shapes_carry_the_actions_envoy_config_renders_for_the_shipped_policy() -> None:
    """docs/gateways.md: the examples send the descriptors of policies/ratelimit/ (what
    ``envoy-config --protocol ratelimit`` renders for it, envoy/envoy-ratelimit.yaml's)."""
    wanted = rate_limits(load_policy([ROOT / "policies" / "ratelimit"]), "edge",
                         {"api_key": "x-api-key", "plan": "x-plan"})
    (istio,) = [p["patch"]["value"]["rate_limits"] for d in docs(EXAMPLES / "istio" / "envoyfilter-ratelimit.yaml")
                for p in d["spec"]["configPatches"] if p["applyTo"] == "VIRTUAL_HOST"]
    (gateway,) = [p["operation"]["value"] for d in docs(EXAMPLES / "envoy-gateway" / "envoypatchpolicy-ratelimit.yaml")
                  for p in d["spec"]["jsonPatches"] if p["type"].endswith("RouteConfiguration")]
    assert istio == gateway == wanted


def test_the_envoy_gateway_patch_policy_passes_envoy_validation() -> None:
    config: dict[str, Any] = yaml.safe_load(config_path("envoy-gateway.yaml").read_text())
    [listener] = config["static_resources"]["listeners"]
    manager = listener["default_filter_chain"]["filters"][0]["typed_config"]
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    [policy] = docs(EXAMPLES / "envoy-gateway" / "envoypatchpolicy-ratelimit.yaml")
    for patch in policy["spec"]["jsonPatches"]:
        op = patch["operation"]
        assert op["op"] == "add"
        if patch["type"].endswith("Listener"):
            assert patch["name"] == listener["name"]
            prefix = "/default_filter_chain/filters/0/typed_config/http_filters/"
            assert op["path"].startswith(prefix)
            manager["http_filters"].insert(int(op["path"][len(prefix):]), copy.deepcopy(op["value"]))
        else:
            assert patch["name"] == manager["route_config"]["name"]
            assert op["path"] == "/virtual_hosts/0/rate_limits"
            manager["route_config"]["virtual_hosts"][0]["rate_limits"] = copy.deepcopy(op["value"])
    names = [f["name"] for f in manager["http_filters"]]
    assert names[-2:] == [RATELIMIT_FILTER, ROUTER]  # after every ext_authz filter
    rls = manager["http_filters"][-2]["typed_config"]["rate_limit_service"]["grpc_service"]["envoy_grpc"]
    assert rls["cluster_name"] in clusters  # the SecurityPolicy's gRPC cluster Envoy Gateway generates
    validate(yaml.safe_dump(config, sort_keys=False))


async def test_the_istio_envoyfilters_answer_through_a_real_envoy(tmp_path: Path) -> None:
    srv = Server(ServerConfig(policies=[str(ROOT / "policies" / "ratelimit")], listen=f"127.0.0.1:{free_port()}",
                              admin_listen="off", reload_interval=0, identity_salt="s", grpc_server="asyncio"),
                 clock=ManualClock(START))  # the minute's window: 11 requests never straddle two
    await srv.start()
    try:
        with start_upstream("127.0.0.1") as upstream, \
                EnvoyProcess(istio_config(srv.port, upstream.port)) as envoy:
            free = {"x-api-key": "k1", "x-plan": "free", "host": "api.default.svc.cluster.local:8080"}
            codes = [(await asyncio.to_thread(get, envoy.url + "/a", free))[0] for _ in range(11)]
            assert codes == [200] * 10 + [429]  # free-per-key: 10 a minute
        assert srv.ratelimit is not None and srv.ratelimit.door.decided >= 11
    finally:
        await srv.stop(grace=0)
