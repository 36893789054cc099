"""The Istio example for the HTTP protocol (documented, not run: no cluster) says what
envoy/envoy-http.yaml says: same headers, lease metadata and 420 -> 503 mapper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ISTIO = ROOT / "helm" / "extauthz" / "examples" / "istio"
# istio/api mesh/v1alpha1/config.proto, EnvoyExternalAuthorizationHttpProvider
PROVIDER_FIELDS = {"service", "port", "timeout", "pathPrefix", "failOpen", "statusOnError",
                   "includeRequestHeadersInCheck", "includeAdditionalHeadersInCheck",
                   "includeRequestBodyInCheck", "headersToUpstreamOnAllow",
                   "headersToDownstreamOnAllow", "headersToDownstreamOnDeny"}


def shipped() -> tuple[dict[str, Any], dict[str, Any]]:
    config = yaml.safe_load((ROOT / "envoy" / "envoy-http.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_authz")
    return hcm, ext


def exact(matcher: dict[str, Any]) -> list[str]:
    return [p["exact"] for p in matcher["patterns"]]


def test_http_provider_matches_the_shipped_envoy_config() -> None:
    mesh = yaml.safe_load((ISTIO / "meshconfig-http.yaml").read_text())
    providers = {p["name"]: p for p in mesh["meshConfig"]["extensionProviders"]}
    http = providers["extauthz"]["envoyExtAuthzHttp"]
    assert set(http) <= PROVIDER_FIELDS
    assert http["failOpen"] is True and http["timeout"] == "0.25s"
    _, ext = shipped()
    response = ext["http_service"]["authorization_response"]
    # the route-tier header is Envoy-config only (Istio routes carry none)
    assert set(http["includeRequestHeadersInCheck"]) == set(exact(ext["allowed_headers"])) - {"x-extauthz-route-tier"}
    assert http["headersToUpstreamOnAllow"] == exact(response["allowed_upstream_headers"])
    assert http["headersToDownstreamOnAllow"] == exact(response["allowed_client_headers_on_success"])
    assert http["headersToDownstreamOnDeny"] == exact(response["allowed_client_headers"])
    assert providers["extauthz-als"]["envoyHttpAls"]["port"] == 9001  # leases: the gRPC access log


def test_http_envoyfilter_adds_lease_metadata_and_the_503_mapper() -> None:
    [envoy_filter] = [d for d in yaml.safe_load_all((ISTIO / "envoyfilter-http.yaml").read_text()) if d]
    patches = {p["applyTo"]: p["patch"]["value"]["typed_config"] for p in envoy_filter["spec"]["configPatches"]
               if p["patch"]["operation"] == "MERGE"}
    hcm, ext = shipped()
    got = patches["HTTP_FILTER"]["http_service"]["authorization_response"]["dynamic_metadata_from_headers"]
    assert got == ext["http_service"]["authorization_response"]["dynamic_metadata_from_headers"]
    assert patches["NETWORK_FILTER"]["local_reply_config"] == hcm["local_reply_config"]


def test_http_envoyfilter_strips_client_copies_before_jwt_authn_and_ext_authz() -> None:
    """What envoy-http.yaml's first filter removes, except the route tier (Istio sets none and
    does not send it): a client's x-jwt-payload would otherwise name any user whenever a
    request carries no token, and a client's x-extauthz-tier reach the upstream on fail-open."""
    [envoy_filter] = [d for d in yaml.safe_load_all((ISTIO / "envoyfilter-http.yaml").read_text()) if d]
    first = [p for p in envoy_filter["spec"]["configPatches"]
             if p["applyTo"] == "HTTP_FILTER" and p["patch"]["operation"] == "INSERT_FIRST"]
    assert len(first) == 1 and first[0]["match"]["context"] == "GATEWAY"
    removed = [m["remove"] for m in first[0]["patch"]["value"]["typed_config"]["mutations"]["request_mutations"]]
    hcm, _ = shipped()
    strip = next(f for f in hcm["http_filters"] if f["name"] == "extauthz.strip-route-tier")
    shipped_removed = [m["remove"] for m in strip["typed_config"]["mutations"]["request_mutations"]]
    assert removed == [h for h in shipped_removed if h != "x-extauthz-route-tier"]
