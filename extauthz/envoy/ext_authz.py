"""The ext_authz targets: the Check call (``--protocol grpc``, ``grpc_service``) and Envoy's
HTTP authorization protocol (``--protocol http``, ``http_service`` to ``serve --http-listen``).

Each is a :class:`~extauthz.envoy.config.Target`: the ext_authz filter with the headers the
policy reads (:func:`~extauthz.envoy.headers.allowed_headers`), fail-open stated, and the
filter before it that removes a client's copies of the trusted headers; on HTTP also the
route-tier header filter and the local-reply mapper that turns the server's 420 (a shed
request) into 503.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD, TIER_HEADER
from .blocks import CONNECT_TIMEOUT, Config, authz_timeout, cluster, grpc_cluster, http1, patterns, strip, typed
from .headers import (
    CLIENT_HEADERS_ON_DENY,
    CLIENT_HEADERS_ON_SUCCESS,
    FAILURE_MODE_HEADER,
    JWT_NAMESPACE,
    JWT_PAYLOAD_HEADER,
    ROUTE_TIER_HEADER,
    SHED_STATUS,
    allowed_headers,
)
from .records import EXT_AUTHZ_NAMESPACE

if TYPE_CHECKING:
    from .frame import Build

__all__ = ["EXT_AUTHZ_FILTER", "GRPC", "HTTP", "GrpcExtAuthz", "HttpExtAuthz"]

#: the filter's name, which is also the namespace of the dynamic metadata it sets
EXT_AUTHZ_FILTER = EXT_AUTHZ_NAMESPACE
_EXT_AUTHZ = typed("envoy.extensions.filters.http.ext_authz.v3.ExtAuthz")
_PER_ROUTE = typed("envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute")
_MUTATION = typed("envoy.extensions.filters.http.header_mutation.v3.HeaderMutation")
_ROUTE_MUTATION = typed("envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute")
#: the filter that sets the route-tier header from each route's per-route config (HTTP)
ROUTE_TIER_FILTER = "extauthz.route-tier"


def _allowed(b: Build, protocol: str) -> Config:
    names = b.options.allowed_headers
    return patterns(list(names) if names is not None else allowed_headers(b.policy.needed_headers, protocol))


def _skip(b: Build) -> Config:
    return {EXT_AUTHZ_FILTER: {"@type": _PER_ROUTE, "disabled": True}} if b.options.ext_authz else {}


class GrpcExtAuthz:
    """``--protocol grpc``: the Check call on the server's gRPC port, which the access log
    shares by default (one ``extauthz`` cluster)."""

    default_authz = ("127.0.0.1", 9001)
    grpc_cluster: str | None = "extauthz"
    carries_metadata = True
    tls = True

    def filters(self, b: Build) -> list[Config]:
        filters = [strip("extauthz.strip-tier", [TIER_HEADER, FAILURE_MODE_HEADER])]
        if not b.options.ext_authz:
            return filters
        config: Config = {
            "@type": _EXT_AUTHZ,
            "grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"},
                             "timeout": authz_timeout(b.options.check_budget_ms)},
            "transport_api_version": "V3",
            "failure_mode_allow": True,
            "failure_mode_allow_header_add": True,
            "route_metadata_context_namespaces": [b.policy.route_metadata_namespace],
        }
        if b.options.jwt is not None:
            # the verified payload, for policy rules `metadata: {namespace: envoy.filters.http.jwt_authn}`
            config["metadata_context_namespaces"] = [JWT_NAMESPACE]
        config.update({"include_peer_certificate": False, "emit_filter_state_stats": True})
        if not b.options.send_all_headers:  # unset: Envoy sends every header
            config["allowed_headers"] = _allowed(b, "grpc")
        return [*filters, {"name": EXT_AUTHZ_FILTER, "typed_config": config}]

    def clusters(self, b: Build) -> list[Config]:
        return [grpc_cluster("extauthz", b.authz, b.options.tls, more=b.authz_more)]

    def manager(self, b: Build, hcm: Config, vhost: Config) -> None:
        pass

    def skip_route(self, b: Build) -> Config:
        return _skip(b)

    def route_tier(self, b: Build, tier: str) -> Config:
        """Route metadata where the policy reads the tier."""
        namespace, path = b.policy.route_metadata
        value: Any = tier
        for step in reversed(path):
            if not isinstance(step, str):
                raise ValueError(f"--quickstart-routes: the policy reads the tier at a list index "
                                 f"({namespace}: {list(path)}); tag your own routes")
            value = {step: value}
        return {"metadata": {"filter_metadata": {namespace: value}}}

    def extension_route(self, b: Build, tier: str) -> Config:
        if not b.options.ext_authz:
            return {}
        return {"typed_per_filter_config": {EXT_AUTHZ_FILTER: {
            "@type": _PER_ROUTE, "check_settings": {"context_extensions": {"tier": tier}}}}}


class HttpExtAuthz:
    """``--protocol http``: ``http_service`` to the server's HTTP authorization port; the
    access log goes to its gRPC port (a cluster of its own). The protocol carries no route
    metadata: the route-tier header stands in for it."""

    default_authz = ("127.0.0.1", 9003)
    grpc_cluster: str | None = None
    carries_metadata = False
    tls = False

    def filters(self, b: Build) -> list[Config]:
        if b.options.send_all_headers:
            raise ValueError("send_all_headers: only the gRPC protocol sends unlisted headers")
        filters = [strip("extauthz.strip-route-tier", [ROUTE_TIER_HEADER, JWT_PAYLOAD_HEADER, TIER_HEADER,
                                                      FAILURE_MODE_HEADER]),
                   {"name": ROUTE_TIER_FILTER, "typed_config": {"@type": _MUTATION}}]
        if not b.options.ext_authz:
            return filters
        host, port = b.authz
        return [*filters, {"name": EXT_AUTHZ_FILTER, "typed_config": {
            "@type": _EXT_AUTHZ,
            "transport_api_version": "V3",
            "failure_mode_allow": True,
            "failure_mode_allow_header_add": True,
            "emit_filter_state_stats": True,
            "http_service": {
                "server_uri": {"uri": f"http://{host}:{port}", "cluster": "extauthz_http",
                               "timeout": authz_timeout(b.options.check_budget_ms)},
                "authorization_response": {
                    "allowed_upstream_headers": patterns([TIER_HEADER]),
                    "allowed_client_headers_on_success": patterns(list(CLIENT_HEADERS_ON_SUCCESS)),
                    "allowed_client_headers": patterns(list(CLIENT_HEADERS_ON_DENY)),
                    "dynamic_metadata_from_headers": patterns([LEASE_ID_FIELD, LEASES_FIELD, LEASE_TICKET_FIELD]),
                },
            },
            "allowed_headers": _allowed(b, "http"),
        }}]

    def clusters(self, b: Build) -> list[Config]:
        return [cluster("extauthz_http", b.authz, CONNECT_TIMEOUT, more=b.authz_more,
                        typed_extension_protocol_options=http1("300s"))]

    def manager(self, b: Build, hcm: Config, vhost: Config) -> None:
        """The shed status to 503 (Envoy passes no 5xx from the server), and the route-tier
        header never leaves Envoy."""
        hcm["local_reply_config"] = {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": SHED_STATUS, "runtime_key": "extauthz.shed_status"}}}},
            "status_code": 503}]}
        vhost["request_headers_to_remove"] = [ROUTE_TIER_HEADER]

    def skip_route(self, b: Build) -> Config:
        return _skip(b)

    def route_tier(self, b: Build, tier: str) -> Config:
        """The route-tier header, set by the route-tier filter's per-route config."""
        return {"typed_per_filter_config": {ROUTE_TIER_FILTER: {"@type": _ROUTE_MUTATION, "mutations": {
            "request_mutations": [{"append": {"header": {"key": ROUTE_TIER_HEADER, "value": tier},
                                              "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}}}

    def extension_route(self, b: Build, tier: str) -> Config:
        return self.route_tier(b, tier)


GRPC = GrpcExtAuthz()
HTTP = HttpExtAuthz()
