"""``extauthz envoy-config``: a complete Envoy bootstrap for a policy.

One listener in front of one upstream, with the ext_authz filter on the gRPC protocol
(``grpc_service``, the Check call) or Envoy's HTTP authorization protocol (``http_service``,
``serve --http-listen``), and around it what the server relies on:

* ``allowed_headers``: the request headers the policy reads (:func:`server.httpmap.allowed_headers`,
  the list ``extauthz envoy-allowed-headers`` prints);
* filters that remove a client's copies of the headers the server or the upstream trusts (the
  tier for the upstream and Envoy's fail-open mark ``x-envoy-auth-failure-mode-allowed``; on
  HTTP also the route tier and the JWT payload header), and requests with an underscore in a
  header name refused (400), so that no upstream folding ``_`` into ``-`` reads a header the
  policy did not see;
* on HTTP, the local-reply mapper that turns the server's 420 (a shed request) into 503;
* the gRPC access log that releases leases, only when the policy holds a lease limiter
  (``access_log="auto"``; ``always``/``never`` force it), or Envoy's fluentd access logger to
  the server's fluentd port (``access_log="fluentd"``, ``serve --fluentd-listen``: the cheaper
  release path, docs/design.md "The release path");

and on request: OpenTelemetry tracing to a collector (``tracing``), the quick start's demo
routes (``quickstart_routes``), and a ``jwt_authn`` filter in front of ext_authz (``jwt``).

Each shipped ``envoy/envoy.yaml``, ``envoy-http.yaml``, ``envoy-tls.yaml`` and ``envoy-jwt.yaml``
is exactly this output for the command line in its header (tests/e2e/test_envoy_bootstrap.py).
docs/envoy.md.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

import yaml

from .answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD, TIER_HEADER
from .envoy.rlqs import envoy_limiters, quota_filters
from .policy.model import Policy
from .policy.schema import ConcurrentRequestsSpec, FleetUsageSpec, WorkerUtilizationSpec
from .server.fluentd import RECORD as FLUENTD_RECORD
from .server.fluentd import TAG as FLUENTD_TAG
from .server.httpmap import JWT_PAYLOAD_HEADER, ROUTE_TIER_HEADER, SHED_STATUS, allowed_headers
from .server.leases import FAILURE_MODE_HEADER, ROUTE_TIER_TAG
from .settings import CHECK_BUDGET_MS, ENVOY_MARGIN_MS

__all__ = ["ACCESS_LOG_MODES", "CLIENT_HEADERS_ON_DENY", "CLIENT_HEADERS_ON_SUCCESS", "DEFAULT_AUTHZ",
           "JwtProvider", "TlsFiles", "authz_timeout", "bootstrap", "holds_leases",
           "jwks_from_file", "render"]

Config = dict[str, Any]

#: auto stays the gRPC stream: the fluentd port is off unless ``serve --fluentd-listen`` is
#: given, is plaintext, and Envoy still calls its logger young (docs/envoy.md)
ACCESS_LOG_MODES = ("auto", "always", "never", "fluentd")
#: where Envoy reaches the server, by protocol (the gRPC port; the HTTP authorization port)
DEFAULT_AUTHZ = {"grpc": ("127.0.0.1", 9001), "http": ("127.0.0.1", 9003)}
#: the answer headers the HTTP protocol passes to the client, on an allowed and a refused check
#: (``extauthz k8s`` names the same in Istio's provider)
CLIENT_HEADERS_ON_SUCCESS = ("ratelimit-policy", "ratelimit")
CLIENT_HEADERS_ON_DENY = ("content-type", "retry-after", "ratelimit-policy", "ratelimit")
#: the gRPC port that receives the access log, when only its host is known
ACCESS_LOG_PORT = 9001
#: the fluentd release port (``serve --fluentd-listen``) on the ``--authz`` host, by default
FLUENTD_PORT = 9004
#: the server's name in its certificate when ``--authz`` is an address (the chart's Service)
DEFAULT_SERVER_NAME = "extauthz"
#: connect timeouts to the server, the access-log port and the collector
CONNECT_TIMEOUT = "0.25s"
#: access-log batching: a message every 5 ms or 4 KiB (docs/limiters.md "Access-log batching")
ACCESS_LOG_BUFFER_BYTES = 4096
ACCESS_LOG_FLUSH = "0.005s"
#: an entry for each request still in flight this often (``access_log_flush_interval``), where
#: the policy has a ``fleet_usage`` limiter: one that Envoy let through unchecked is counted by
#: the fleet from its first such entry to its last (docs/limiters.md "Unchecked requests")
UNCHECKED_FLUSH = "1s"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_AUTHZ = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_PROTOCOL_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_ROUTE_MUTATION = ("type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3."
                   "HeaderMutationPerRoute")
_JWT_AUTHN = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
#: the filter whose dynamic metadata (namespace) holds the verified JWT payload
JWT_AUTHN_FILTER = "envoy.filters.http.jwt_authn"
#: the quick start's demo routes: (name, path prefix, POST only, tier); policies/ classifies the rest
QUICKSTART_TIERS = (("charges_post", "/v1/charges", True, "critical"), ("refunds", "/v1/refunds", False, "critical"),
                    ("reports", "/v1/reports", False, "get"))
#: the demo route whose tier travels in the Check call's context_extensions (gRPC)
QUICKSTART_EXT = ("ext", "/v1/ext/", "post")


@dataclass(frozen=True)
class TlsFiles:
    """Envoy's client certificate, key and the CA that signed the server's certificate."""

    cert: str
    key: str
    ca: str


@dataclass(frozen=True)
class JwtProvider:
    """The token issuer ``jwt_authn`` verifies against: its ``iss``, the accepted ``aud``
    values (none: any), and its JWKS as JSON text (inlined: ``local_jwks``)."""

    issuer: str
    audiences: tuple[str, ...]
    jwks: str


def jwks_from_file(path: str) -> str:
    """A JWKS file's text, checked to be a JSON object with a non-empty ``keys`` list."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--jwt-jwks-file: cannot read {path}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--jwt-jwks-file: {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list) or not doc["keys"]:
        raise ValueError(f"--jwt-jwks-file: {path} is not a JWKS (a JSON object with a non-empty \"keys\" list)")
    return text.strip()


def holds_leases(policy: Policy) -> bool:
    """Whether a request can hold a lease that only the access log (or its TTL) ends."""
    for spec in policy.limiters:
        if isinstance(spec, ConcurrentRequestsSpec | FleetUsageSpec):
            return True
        if isinstance(spec, WorkerUtilizationSpec) and spec.signal.source == "inflight":
            return True
    return False


def authz_timeout(check_budget_ms: float = CHECK_BUDGET_MS) -> str:
    """Envoy's ext_authz ``timeout``: the server's check budget (``serve --check-budget-ms``)
    plus :data:`~extauthz.settings.ENVOY_MARGIN_MS`, so that a starved server's decision
    (``extauthz.overload``) lands before Envoy gives up and fails the check open."""
    return f"{round(check_budget_ms + ENVOY_MARGIN_MS) / 1000:g}s"


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
    return _cluster(name, endpoint, CONNECT_TIMEOUT, **extra)


#: request headers the access log never carries, whatever the policy reads: credentials
NEVER_LOGGED = frozenset({"authorization", "proxy-authorization", "cookie"})


def secret_headers(policy: Policy) -> frozenset[str]:
    """The request headers that may carry a credential: the policy's identity, plan and key
    part headers, and :data:`NEVER_LOGGED`."""
    sources = (*policy.identity, *policy.plan_sources,
               *(part.source for key in policy.keys for part in key.parts if part.source is not None))
    return NEVER_LOGGED | {s.header.lower() for s in sources if s.header}


def unchecked_headers(policy: Policy) -> list[str]:
    """The request headers the access log carries back so that the server can count a request
    Envoy let through unchecked (docs/limiters.md "Unchecked requests"): Envoy's fail-open
    header, then the headers the policy's tier rules and test header read, less every header
    that may carry a credential (:func:`secret_headers`: no API key goes to the log; a tier
    rule on such a header then never matches an unchecked request's entry)."""
    names = {h.lower() for rule in policy.rules for h in rule.matcher.header_names}
    if policy.test_header:
        names.add(policy.test_header.lower())
    return [FAILURE_MODE_HEADER, *sorted(names - secret_headers(policy) - {FAILURE_MODE_HEADER})]


def route_tier_tag(policy: Policy) -> Config | None:
    """The access log's custom tag that carries the route's tier, from route metadata where
    the policy reads it (None: the policy reads it at a list index, which a tag cannot name)."""
    namespace, path = policy.route_metadata
    if not all(isinstance(step, str) for step in path):
        return None
    return {"tag": ROUTE_TIER_TAG, "metadata": {"kind": {"route": {}}, "metadata_key": {
        "key": namespace, "path": [{"key": step} for step in path]}}}


def _access_log(cluster: str, policy: Policy) -> Config:
    common: Config = {"log_name": "extauthz", "transport_api_version": "V3",
                      "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                      "buffer_size_bytes": ACCESS_LOG_BUFFER_BYTES,
                      "buffer_flush_interval": ACCESS_LOG_FLUSH}
    tag = route_tier_tag(policy)
    if tag is not None:
        common["custom_tags"] = [tag]
    return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": common, "additional_request_headers_to_log": unchecked_headers(policy)}}


def fluentd_release_log(to: tuple[str, int]) -> tuple[Config, Config]:
    """The release path through Envoy's fluentd logger: the access log entry and its
    cluster (``extauthz_fluentd``, plain TCP to ``to``: ``serve --fluentd-listen``)."""
    logger: Config = {"name": "envoy.access_loggers.fluentd", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig",
        "cluster": "extauthz_fluentd", "tag": FLUENTD_TAG, "stat_prefix": "extauthz_release",
        "buffer_size_bytes": ACCESS_LOG_BUFFER_BYTES, "buffer_flush_interval": ACCESS_LOG_FLUSH,
        "record": dict(FLUENTD_RECORD)}}
    return logger, _cluster("extauthz_fluentd", to, CONNECT_TIMEOUT)


def _strip(name: str, headers: list[str]) -> Config:
    return {"name": name, "typed_config": {"@type": _MUTATION, "mutations": {
        "request_mutations": [{"remove": h} for h in headers]}}}


def _patterns(names: list[str]) -> Config:
    return {"patterns": [{"exact": n} for n in names]}


def _grpc_ext_authz(policy: Policy, jwt: bool, timeout: str) -> Config:
    config: Config = {
        "@type": _EXT_AUTHZ,
        "grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"}, "timeout": timeout},
        "transport_api_version": "V3",
        "failure_mode_allow": True,
        "failure_mode_allow_header_add": True,
        "route_metadata_context_namespaces": [policy.route_metadata_namespace],
    }
    if jwt:  # the verified payload, for policy rules `metadata: {namespace: envoy.filters.http.jwt_authn}`
        config["metadata_context_namespaces"] = [JWT_AUTHN_FILTER]
    config.update({"include_peer_certificate": False, "emit_filter_state_stats": True,
                   "allowed_headers": _patterns(allowed_headers(policy.needed_headers, "grpc"))})
    return {"name": "envoy.filters.http.ext_authz", "typed_config": config}


def _jwt_authn(provider: JwtProvider, protocol: str) -> Config:
    """Verify a token when there is one (a bad one: 401 from Envoy); without one, pass on."""
    verified: Config = {"issuer": provider.issuer}
    if provider.audiences:
        verified["audiences"] = list(provider.audiences)
    verified.update({"local_jwks": {"inline_string": provider.jwks},
                     "forward": True,  # the Authorization header still reaches the upstream
                     "payload_in_metadata": "payload"})
    if protocol == "http":  # the HTTP protocol carries no metadata: the payload travels in a header
        verified["forward_payload_header"] = JWT_PAYLOAD_HEADER
    return {"name": JWT_AUTHN_FILTER, "typed_config": {
        "@type": _JWT_AUTHN, "providers": {"issuer": verified},
        "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
            {"provider_name": "issuer"}, {"allow_missing": {}}]}}}]}}


def _tracing(cluster: str) -> Config:
    return {"random_sampling": {"value": 100}, "provider": {
        "name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": CONNECT_TIMEOUT},
            "service_name": "envoy"}}}


def _http_ext_authz(policy: Policy, authz: tuple[str, int], timeout: str) -> Config:
    return {"name": "envoy.filters.http.ext_authz", "typed_config": {
        "@type": _EXT_AUTHZ,
        "transport_api_version": "V3",
        "failure_mode_allow": True,
        "failure_mode_allow_header_add": True,
        "emit_filter_state_stats": True,
        "http_service": {
            "server_uri": {"uri": f"http://{authz[0]}:{authz[1]}", "cluster": "extauthz_http",
                           "timeout": timeout},
            "authorization_response": {
                "allowed_upstream_headers": _patterns([TIER_HEADER]),
                "allowed_client_headers_on_success": _patterns(list(CLIENT_HEADERS_ON_SUCCESS)),
                "allowed_client_headers": _patterns(list(CLIENT_HEADERS_ON_DENY)),
                "dynamic_metadata_from_headers": _patterns([LEASE_ID_FIELD, LEASES_FIELD, LEASE_TICKET_FIELD]),
            },
        },
        "allowed_headers": _patterns(allowed_headers(policy.needed_headers, "http")),
    }}


def _route_tier(policy: Policy, protocol: str, tier: str) -> Config:
    """What names a route's tier: route metadata where the policy reads it (gRPC), or the
    route-tier header set by the ``extauthz.route-tier`` filter's per-route config (HTTP)."""
    if protocol == "http":
        return {"typed_per_filter_config": {"extauthz.route-tier": {"@type": _ROUTE_MUTATION, "mutations": {
            "request_mutations": [{"append": {"header": {"key": ROUTE_TIER_HEADER, "value": tier},
                                              "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}}}
    namespace, path = policy.route_metadata
    value: Any = tier
    for step in reversed(path):
        if not isinstance(step, str):
            raise ValueError(f"--quickstart-routes: the policy reads the tier at a list index "
                             f"({namespace}: {list(path)}); tag your own routes")
        value = {step: value}
    return {"metadata": {"filter_metadata": {namespace: value}}}


def _quickstart_routes(policy: Policy, protocol: str) -> list[Config]:
    """The quick start's demo routes: tiers by route (metadata on gRPC, the route-tier header
    on HTTP) and by context extension (gRPC), then the untagged /v1/."""
    routes: list[Config] = []
    for name, prefix, post_only, tier in QUICKSTART_TIERS:
        match: Config = {"prefix": prefix}
        if post_only:
            match["headers"] = [{"name": ":method", "string_match": {"exact": "POST"}}]
        routes.append({"name": name, "match": match, "route": {"cluster": "upstream"},
                       **_route_tier(policy, protocol, tier)})
    name, prefix, tier = QUICKSTART_EXT
    route: Config = {"name": name, "match": {"prefix": prefix}, "route": {"cluster": "upstream"}}
    if protocol == "http":
        route.update(_route_tier(policy, protocol, tier))
    else:
        route["typed_per_filter_config"] = {"envoy.filters.http.ext_authz": {
            "@type": _PER_ROUTE, "check_settings": {"context_extensions": {"tier": tier}}}}
    routes.append(route)
    routes.append({"name": "v1", "match": {"prefix": "/v1/"}, "route": {"cluster": "upstream"}})
    return routes


def _routes(extra: list[Config]) -> list[Config]:
    return [
        {"name": "healthz", "match": {"path": "/healthz"},
         "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
         "typed_per_filter_config": {"envoy.filters.http.ext_authz": {"@type": _PER_ROUTE, "disabled": True}}},
        *extra,
        {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
    ]


def bootstrap(policy: Policy, *, protocol: str, upstream: tuple[str, int],
              authz: tuple[str, int] | None = None, access_log_to: tuple[str, int] | None = None,
              listen_port: int = 10000, tls: TlsFiles | None = None, access_log: str = "auto",
              admin_port: int = 9901, tracing: tuple[str, int] | None = None,
              quickstart_routes: bool = False, jwt: JwtProvider | None = None,
              check_budget_ms: float = CHECK_BUDGET_MS, rlqs: bool = False) -> Config:
    """The bootstrap as a mapping (see the module docstring); the ext_authz timeout is
    :func:`authz_timeout` of the server's ``check_budget_ms``; ``rlqs``: the rate limit quota
    filters of the policy's ``enforce: envoy`` limiters before ext_authz (extauthz/envoy/rlqs.py)."""
    if protocol not in DEFAULT_AUTHZ:
        raise ValueError(f"protocol must be one of {', '.join(DEFAULT_AUTHZ)}, not {protocol!r}")
    if access_log not in ACCESS_LOG_MODES:
        raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, not {access_log!r}")
    if tls is not None and protocol != "grpc":
        raise ValueError("TLS to the server is for the gRPC protocol only (the HTTP port is plaintext)")
    enforced_in_envoy = [spec.name for spec in envoy_limiters(policy)]
    if rlqs and not enforced_in_envoy:
        raise ValueError("--rlqs: the policy has no limiter with enforce: envoy")
    if enforced_in_envoy and not rlqs:
        raise ValueError(f"the policy enforces {', '.join(enforced_in_envoy)} in Envoy: add --rlqs "
                         "(without the quota filter nothing would enforce them)")
    authz = authz or DEFAULT_AUTHZ[protocol]
    log = access_log == "always" or (access_log == "auto" and holds_leases(policy))
    # the access log's gRPC port: by default the Check port (gRPC) or port 9001 of its host (HTTP)
    log_to = access_log_to or (authz if protocol == "grpc" else (authz[0], ACCESS_LOG_PORT))
    # one "extauthz" cluster for Check and the access log when they share a port
    log_cluster = "extauthz" if protocol == "http" or log_to == authz else "extauthz_access_log"
    # the fluentd logger and its cluster: plain TCP, by default port 9004 of the --authz host
    fluentd = (fluentd_release_log(access_log_to or (authz[0], FLUENTD_PORT))
               if access_log == "fluentd" else None)

    extra_routes = _quickstart_routes(policy, protocol) if quickstart_routes else []
    vhost: Config = {"name": "api", "domains": ["*"], "routes": _routes(extra_routes)}
    hcm: Config = {
        "@type": _HCM, "stat_prefix": "ingress_http", "codec_type": "AUTO",
        # client-facing: Envoy generates every x-request-id and appends the client's address
        # to x-forwarded-for (docs/security.md "Request ids and paths")
        "use_remote_address": True,
        # one normalized path for routes, ext_authz and the upstream (policy path rules)
        "normalize_path": True, "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        # x_api_key refused (400), not passed on: an upstream that folds "_" into "-" (CGI,
        # WSGI) would read it as the x-api-key the policy never saw (docs/security.md)
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
    }
    if tracing is not None:
        hcm["tracing"] = _tracing("otel_collector")
    if protocol == "http":
        hcm["local_reply_config"] = {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": SHED_STATUS, "runtime_key": "extauthz.shed_status"}}}},
            "status_code": 503}]}
        vhost["request_headers_to_remove"] = [ROUTE_TIER_HEADER]
        filters = [_strip("extauthz.strip-route-tier", [ROUTE_TIER_HEADER, JWT_PAYLOAD_HEADER, TIER_HEADER,
                                                        FAILURE_MODE_HEADER]),
                   {"name": "extauthz.route-tier", "typed_config": {"@type": _MUTATION}},
                   _http_ext_authz(policy, authz, authz_timeout(check_budget_ms))]
    else:
        filters = [_strip("extauthz.strip-tier", [TIER_HEADER, FAILURE_MODE_HEADER]),
                   _grpc_ext_authz(policy, jwt is not None, authz_timeout(check_budget_ms))]
    if jwt is not None:  # right after the strip filter: what it verifies, nobody else can set
        filters.insert(1, _jwt_authn(jwt, protocol))
    # the quota stream goes to the gRPC port: the Check cluster, or port 9001 of the HTTP host
    rlqs_cluster = "extauthz" if protocol == "grpc" else "extauthz_rlqs"
    if rlqs:  # before ext_authz: a request Envoy refuses costs the server nothing
        filters[-1:-1] = quota_filters(policy, rlqs_cluster)
    if log:
        hcm["access_log"] = [_access_log(log_cluster, policy)]
        if any(isinstance(spec, FleetUsageSpec) for spec in policy.limiters):
            hcm["access_log_options"] = {"access_log_flush_interval": UNCHECKED_FLUSH}
    elif fluentd is not None:
        hcm["access_log"] = [fluentd[0]]
    hcm["route_config"] = {"name": "local_route", "virtual_hosts": [vhost]}
    hcm["http_filters"] = [*filters, {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]

    clusters: list[Config] = []
    if protocol == "http":
        clusters.append(_cluster("extauthz_http", authz, CONNECT_TIMEOUT, typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _PROTOCOL_OPTIONS, "common_http_protocol_options": {"idle_timeout": "300s"},
                "explicit_http_config": {"http_protocol_options": {}}}}))
    if protocol == "grpc":
        clusters.append(_grpc_cluster("extauthz", authz, tls))
    if log and not (protocol == "grpc" and log_cluster == "extauthz"):
        clusters.append(_grpc_cluster(log_cluster, log_to, tls))
    if fluentd is not None:
        clusters.append(fluentd[1])
    if rlqs and rlqs_cluster != "extauthz":
        clusters.append(_grpc_cluster(rlqs_cluster, (authz[0], ACCESS_LOG_PORT), None))
    clusters.append(_cluster("upstream", upstream, "1s"))
    if tracing is not None:
        clusters.append(_cluster("otel_collector", tracing, CONNECT_TIMEOUT, typed_extension_protocol_options=_http2()))
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
