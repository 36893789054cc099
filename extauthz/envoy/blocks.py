"""The building blocks every Envoy config target uses: addresses, clusters (plain, HTTP/2,
mTLS), header-removal filters and header patterns. Plain mappings, as Envoy's YAML has them."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.settings import CHECK_BUDGET_MS, ENVOY_MARGIN_MS

__all__ = ["CONNECT_TIMEOUT", "DEFAULT_SERVER_NAME", "HEALTHZ_PATH", "Config", "TlsFiles", "address",
           "answering_listener", "authz_timeout", "check_port", "cluster", "grpc_cluster", "http1", "http2", "is_ip",
           "patterns", "router", "strip", "typed"]

Config = dict[str, Any]

#: connect timeouts to the server, the access-log port and the collector
CONNECT_TIMEOUT = "0.25s"
#: the server's name in its certificate when ``--authz`` is an address (the chart's Service)
DEFAULT_SERVER_NAME = "extauthz"
#: Envoy's own health route, answered by Envoy without a check (nor a quota filter's bucket)
HEALTHZ_PATH = "/healthz"
_TYPE = "type.googleapis.com/"
_MUTATION = "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@dataclass(frozen=True)
class TlsFiles:
    """Envoy's client certificate, key and the CA that signed the server's certificate."""

    cert: str
    key: str
    ca: str


def typed(message: str) -> str:
    """The ``@type`` URL of an Envoy message (its full protobuf name)."""
    return _TYPE + message


def authz_timeout(check_budget_ms: float = CHECK_BUDGET_MS) -> str:
    """Envoy's timeout for a call to the server: its check budget (``serve --check-budget-ms``)
    plus :data:`~extauthz.core.settings.ENVOY_MARGIN_MS`, so that a starved server's decision
    (``extauthz.engine.overload``) lands before Envoy gives up and fails the check open."""
    return f"{round(check_budget_ms + ENVOY_MARGIN_MS) / 1000:g}s"


def check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")


def address(host: str, port: int) -> Config:
    return {"socket_address": {"address": host, "port_value": port}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cluster(name: str, endpoint: tuple[str, int], connect_timeout: str, *,
            more: Sequence[tuple[str, int]] = (), **extra: Any) -> Config:
    """A cluster of ``endpoint`` (and ``more``, all on one host kind): STATIC for addresses,
    STRICT_DNS for host names."""
    endpoints = [endpoint, *more]
    for _, port in endpoints:
        check_port(port)
    built: Config = {"name": name, "type": "STATIC" if is_ip(endpoint[0]) else "STRICT_DNS",
                     "connect_timeout": connect_timeout, **extra}
    built["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": address(*e)}} for e in endpoints]}]}
    return built


def http2() -> Config:
    return {_PROTOCOL_OPTIONS: {"@type": typed(_PROTOCOL_OPTIONS), "explicit_http_config": {
        "http2_protocol_options": {}}}}


def http1(idle_timeout: str) -> Config:
    return {_PROTOCOL_OPTIONS: {
        "@type": typed(_PROTOCOL_OPTIONS), "common_http_protocol_options": {"idle_timeout": idle_timeout},
        "explicit_http_config": {"http_protocol_options": {}}}}


def _tls_socket(tls: TlsFiles, server_name: str) -> Config:
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": typed("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
        "sni": server_name,
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": tls.cert},
                                  "private_key": {"filename": tls.key}}],
            "validation_context": {"trusted_ca": {"filename": tls.ca}, "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": server_name}}]},
        }}}


def grpc_cluster(name: str, endpoint: tuple[str, int], tls: TlsFiles | None, *,
                 more: Sequence[tuple[str, int]] = ()) -> Config:
    """A cluster the server's gRPC port(s) are in: HTTP/2, mTLS when ``tls`` is given (the
    server's name: ``endpoint``'s host name, else :data:`DEFAULT_SERVER_NAME`)."""
    extra: Config = {"typed_extension_protocol_options": http2()}
    if tls is not None:
        server_name = endpoint[0] if not is_ip(endpoint[0]) else DEFAULT_SERVER_NAME
        extra["transport_socket"] = _tls_socket(tls, server_name)
    return cluster(name, endpoint, CONNECT_TIMEOUT, more=more, **extra)


def strip(name: str, headers: Sequence[str]) -> Config:
    """A ``header_mutation`` filter ``name`` that removes ``headers`` from the request."""
    return {"name": name, "typed_config": {"@type": typed(_MUTATION), "mutations": {
        "request_mutations": [{"remove": h} for h in headers]}}}


def patterns(names: Sequence[str]) -> Config:
    return {"patterns": [{"exact": n} for n in names]}


def client_manager() -> Config:
    """The client-facing connection manager's settings every shipped listener has (the
    protocol adds its routes, filters and logs after them): Envoy generates every
    x-request-id and appends the client's address to x-forwarded-for (docs/security.md
    "Request ids and paths"; the ratelimit filter's remote_address is that address); one
    normalized path for routes, the checks and the upstream (policy path rules); x_api_key
    refused (400), not passed on: an upstream that folds "_" into "-" (CGI, WSGI) would read it
    as the x-api-key the policy never saw (docs/security.md)."""
    return {
        "@type": typed("envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
        "stat_prefix": "ingress_http", "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True, "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
    }


def router() -> Config:
    """The last HTTP filter of every chain: Envoy's router."""
    return {"name": "envoy.filters.http.router", "typed_config": {
        "@type": typed("envoy.extensions.filters.http.router.v3.Router")}}


def answering_listener(name: str, at: tuple[str, int]) -> Config:
    """A listener ``name`` on ``at`` where Envoy answers every request ``200 ok`` itself: a
    benchmark's upstream inside the same Envoy, for a filter that skips a route answering
    directly (the rate limit filter: :mod:`.ratelimit`'s ``direct_upstream``)."""
    manager: Config = {
        "@type": typed("envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
        "stat_prefix": name, "codec_type": "AUTO",
        "route_config": {"virtual_hosts": [{"name": "ok", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
        "http_filters": [router()]}
    return {"name": name, "address": address(*at), "filter_chains": [{"filters": [{
        "name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}]}
