"""``extauthz envoy-config``: a complete Envoy bootstrap for a policy.

One listener in front of one upstream, with the ext_authz filter on the gRPC protocol
(``grpc_service``, the Check call) or Envoy's HTTP authorization protocol (``http_service``,
``serve --http-listen``), and around it what the server relies on:

* ``allowed_headers``: the request headers the policy reads (:func:`server.http.allowed_headers`,
  the list ``extauthz envoy-allowed-headers`` prints);
* filters that remove a client's copies of the headers the server trusts (the tier for the
  upstream; on HTTP also the route tier and the JWT payload header);
* on HTTP, the local-reply mapper that turns the server's 420 (a shed request) into 503;
* the gRPC access log that releases leases, only when the policy holds a lease limiter
  (``access_log="auto"``; ``always``/``never`` force it).

The shipped ``envoy/envoy.yaml``, ``envoy-http.yaml`` and ``envoy-tls.yaml`` are this output plus
the quick start's demo routes and tracing (tests/e2e/test_envoy_bootstrap.py). docs/envoy.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

import yaml

from .answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD, TIER_HEADER
from .policy.model import Policy
from .policy.schema import ConcurrentRequestsSpec, FleetUsageSpec, WorkerUtilizationSpec
from .server.http import JWT_PAYLOAD_HEADER, ROUTE_TIER_HEADER, SHED_STATUS, allowed_headers

__all__ = ["ACCESS_LOG_MODES", "DEFAULT_AUTHZ", "TlsFiles", "bootstrap", "holds_leases", "render"]

Config = dict[str, Any]

ACCESS_LOG_MODES = ("auto", "always", "never")
#: where Envoy reaches the server, by protocol (the gRPC port; the HTTP authorization port)
DEFAULT_AUTHZ = {"grpc": ("127.0.0.1", 9001), "http": ("127.0.0.1", 9003)}
#: the gRPC port that receives the access log, when only its host is known
ACCESS_LOG_PORT = 9001
#: the server's name in its certificate when ``--authz`` is an address (the chart's Service)
DEFAULT_SERVER_NAME = "extauthz"
AUTHZ_TIMEOUT = "0.25s"
#: access-log batching: a message every 5 ms or 4 KiB (docs/limiters.md "Access-log batching")
ACCESS_LOG_BUFFER_BYTES = 4096
ACCESS_LOG_FLUSH = "0.005s"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_AUTHZ = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_PROTOCOL_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@dataclass(frozen=True)
class TlsFiles:
    """Envoy's client certificate, key and the CA that signed the server's certificate."""

    cert: str
    key: str
    ca: str


def holds_leases(policy: Policy) -> bool:
    """Whether a request can hold a lease that only the access log (or its TTL) ends."""
    for spec in policy.limiters:
        if isinstance(spec, ConcurrentRequestsSpec | FleetUsageSpec):
            return True
        if isinstance(spec, WorkerUtilizationSpec) and spec.signal.source == "inflight":
            return True
    return False


def _address(host: str, port: int) -> Config:
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster(name: str, endpoint: tuple[str, int], connect_timeout: str, **extra: Any) -> Config:
    cluster: Config = {"name": name, "type": "STATIC" if _is_ip(endpoint[0]) else "STRICT_DNS",
                       "connect_timeout": connect_timeout, **extra}
    cluster["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": _address(*endpoint)}}]}]}
    return cluster


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _http2() -> Config:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _PROTOCOL_OPTIONS, "explicit_http_config": {"http2_protocol_options": {}}}}


def _tls_socket(tls: TlsFiles, server_name: str) -> Config:
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": server_name,
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": tls.cert},
                                  "private_key": {"filename": tls.key}}],
            "validation_context": {"trusted_ca": {"filename": tls.ca}, "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": server_name}}]},
        }}}


def _grpc_cluster(name: str, endpoint: tuple[str, int], tls: TlsFiles | None) -> Config:
    extra: Config = {"typed_extension_protocol_options": _http2()}
    if tls is not None:
        server_name = endpoint[0] if not _is_ip(endpoint[0]) else DEFAULT_SERVER_NAME
        extra["transport_socket"] = _tls_socket(tls, server_name)
    return _cluster(name, endpoint, AUTHZ_TIMEOUT, **extra)


def _access_log(cluster: str) -> Config:
    return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": {"log_name": "extauthz", "transport_api_version": "V3",
                          "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                          "buffer_size_bytes": ACCESS_LOG_BUFFER_BYTES,
                          "buffer_flush_interval": ACCESS_LOG_FLUSH}}}


def _strip(name: str, headers: list[str]) -> Config:
    return {"name": name, "typed_config": {"@type": _MUTATION, "mutations": {
        "request_mutations": [{"remove": h} for h in headers]}}}


def _patterns(names: list[str]) -> Config:
    return {"patterns": [{"exact": n} for n in names]}


def _grpc_ext_authz(policy: Policy) -> Config:
    return {"name": "envoy.filters.http.ext_authz", "typed_config": {
        "@type": _EXT_AUTHZ,
        "grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"}, "timeout": AUTHZ_TIMEOUT},
        "transport_api_version": "V3",
        "failure_mode_allow": True,
        "failure_mode_allow_header_add": True,
        "route_metadata_context_namespaces": [policy.route_metadata_namespace],
        "include_peer_certificate": False,
        "emit_filter_state_stats": True,
        "allowed_headers": _patterns(allowed_headers(policy.needed_headers, "grpc")),
    }}


def _http_ext_authz(policy: Policy, authz: tuple[str, int]) -> Config:
    return {"name": "envoy.filters.http.ext_authz", "typed_config": {
        "@type": _EXT_AUTHZ,
        "transport_api_version": "V3",
        "failure_mode_allow": True,
        "failure_mode_allow_header_add": True,
        "emit_filter_state_stats": True,
        "http_service": {
            "server_uri": {"uri": f"http://{authz[0]}:{authz[1]}", "cluster": "extauthz_http",
                           "timeout": AUTHZ_TIMEOUT},
            "authorization_response": {
                "allowed_upstream_headers": _patterns([TIER_HEADER]),
                "allowed_client_headers_on_success": _patterns(["ratelimit-policy", "ratelimit"]),
                "allowed_client_headers": _patterns(["content-type", "retry-after", "ratelimit-policy",
                                                     "ratelimit"]),
                "dynamic_metadata_from_headers": _patterns([LEASE_ID_FIELD, LEASES_FIELD, LEASE_TICKET_FIELD]),
            },
        },
        "allowed_headers": _patterns(allowed_headers(policy.needed_headers, "http")),
    }}


def _routes() -> list[Config]:
    return [
        {"name": "healthz", "match": {"path": "/healthz"},
         "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
         "typed_per_filter_config": {"envoy.filters.http.ext_authz": {"@type": _PER_ROUTE, "disabled": True}}},
        {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
    ]


def bootstrap(policy: Policy, *, protocol: str, upstream: tuple[str, int],
              authz: tuple[str, int] | None = None, access_log_to: tuple[str, int] | None = None,
              listen_port: int = 10000, tls: TlsFiles | None = None, access_log: str = "auto",
              admin_port: int = 9901) -> Config:
    """The bootstrap as a mapping (see the module docstring)."""
    if protocol not in DEFAULT_AUTHZ:
        raise ValueError(f"protocol must be one of {', '.join(DEFAULT_AUTHZ)}, not {protocol!r}")
    if access_log not in ACCESS_LOG_MODES:
        raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, not {access_log!r}")
    if tls is not None and protocol != "grpc":
        raise ValueError("TLS to the server is for the gRPC protocol only (the HTTP port is plaintext)")
    authz = authz or DEFAULT_AUTHZ[protocol]
    log = access_log == "always" or (access_log == "auto" and holds_leases(policy))
    # the access log's gRPC port: by default the Check port (gRPC) or port 9001 of its host (HTTP)
    log_to = access_log_to or (authz if protocol == "grpc" else (authz[0], ACCESS_LOG_PORT))
    # one "extauthz" cluster for Check and the access log when they share a port
    log_cluster = "extauthz" if protocol == "http" or log_to == authz else "extauthz_access_log"

    vhost: Config = {"name": "api", "domains": ["*"], "routes": _routes()}
    hcm: Config = {
        "@type": _HCM, "stat_prefix": "ingress_http", "codec_type": "AUTO",
        # client-facing: Envoy generates every x-request-id and appends the client's address
        # to x-forwarded-for (docs/security.md "Request ids and paths")
        "use_remote_address": True,
        # one normalized path for routes, ext_authz and the upstream (policy path rules)
        "normalize_path": True, "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
    }
    if protocol == "http":
        hcm["local_reply_config"] = {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": SHED_STATUS, "runtime_key": "extauthz.shed_status"}}}},
            "status_code": 503}]}
        vhost["request_headers_to_remove"] = [ROUTE_TIER_HEADER]
        filters = [_strip("extauthz.strip-route-tier", [ROUTE_TIER_HEADER, JWT_PAYLOAD_HEADER, TIER_HEADER]),
                   {"name": "extauthz.route-tier", "typed_config": {"@type": _MUTATION}},
                   _http_ext_authz(policy, authz)]
    else:
        filters = [_strip("extauthz.strip-tier", [TIER_HEADER]), _grpc_ext_authz(policy)]
    if log:
        hcm["access_log"] = [_access_log(log_cluster)]
    hcm["route_config"] = {"name": "local_route", "virtual_hosts": [vhost]}
    hcm["http_filters"] = [*filters, {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]

    clusters: list[Config] = []
    if protocol == "http":
        clusters.append(_cluster("extauthz_http", authz, AUTHZ_TIMEOUT, typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _PROTOCOL_OPTIONS, "common_http_protocol_options": {"idle_timeout": "300s"},
                "explicit_http_config": {"http_protocol_options": {}}}}))
    if protocol == "grpc":
        clusters.append(_grpc_cluster("extauthz", authz, tls))
    if log and not (protocol == "grpc" and log_cluster == "extauthz"):
        clusters.append(_grpc_cluster(log_cluster, log_to, tls))
    clusters.append(_cluster("upstream", upstream, "1s"))
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{"name": "ingress", "address": _address("127.0.0.1", listen_port),
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }


def render(policy: Policy, **options: Any) -> str:
    """:func:`bootstrap` as YAML."""
    return yaml.safe_dump(bootstrap(policy, **options), sort_keys=False)
