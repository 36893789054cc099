"""The one Envoy config generator: ``extauthz envoy-config``, the shipped ``envoy/*.yaml``,
and every variant the tests and benchmarks run.

A complete bootstrap: one listener in front of one upstream, the target's filters (by
protocol: :data:`TARGETS`) and around them what the server relies on:

* filters that remove a client's copies of the headers the server or the upstream trusts, and
  requests with an underscore in a header name refused (400), so that no upstream folding
  ``_`` into ``-`` reads a header the policy did not see;
* the gRPC access log that releases leases, only when the policy holds a lease limiter
  (``access_log="auto"``; ``always``/``never`` force it), or Envoy's fluentd access logger to
  the server's fluentd port (``access_log="fluentd"``, ``serve --fluentd-listen``: the cheaper
  release path, docs/design.md "The release path"); the record shapes are
  :mod:`extauthz.envoy.records`';

and on request: OpenTelemetry tracing to a collector (``tracing``), the quick start's demo
routes (``quickstart_routes``), and a ``jwt_authn`` filter in front of the check (``jwt``).

:class:`Options` holds every choice; the last group (``ext_authz`` to ``direct_response``) is
for tests and benchmarks (``envoy-config`` never sets it): the generator writes those variants
itself instead of anything editing its YAML afterwards.

A protocol target (:class:`Target`) is a module that builds its filters, per-route settings
and clusters from a :class:`Build`; adding one is that module plus its line in
:data:`TARGETS` (docs/design.md "Envoy knowledge").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import yaml

from ..policy.model import Policy
from ..policy.schema import ConcurrentRequestsSpec, FleetUsageSpec, WorkerUtilizationSpec
from ..settings import CHECK_BUDGET_MS, MAX_CHECK_BUDGET_MS, MIN_CHECK_BUDGET_MS
from .blocks import (
    CONNECT_TIMEOUT,
    Config,
    TlsFiles,
    address,
    authz_timeout,
    check_port,
    cluster,
    grpc_cluster,
    http2,
    typed,
)
from .ext_authz import EXT_AUTHZ_FILTER, GRPC, HTTP
from .headers import JWT_NAMESPACE, JWT_PAYLOAD_HEADER
from .records import FLUENTD_RECORD, FLUENTD_TAG, route_tier_tag, unchecked_headers
from .rlqs import envoy_limiters, quota_filters

__all__ = ["ACCESS_LOG_BYTES_PER_MS", "ACCESS_LOG_MODES", "DEFAULT_AUTHZ", "EXT_AUTHZ_FILTER", "GRPC_ACCESS_LOGGER",
           "LOCAL_RATELIMIT_FILTER", "SHIPPED_ACCESS_LOG_FLUSH_MS", "TARGETS", "Build", "JwtProvider",
           "LocalRateLimit", "Options", "Target", "TlsFiles", "authz_timeout", "bootstrap", "fluentd_release_log",
           "holds_leases", "jwks_from_file", "render"]

#: auto stays the gRPC stream: the fluentd port is off unless ``serve --fluentd-listen`` is
#: given, is plaintext, and Envoy still calls its logger young (docs/envoy.md)
ACCESS_LOG_MODES = ("auto", "always", "never", "fluentd")
#: the gRPC port that receives the access log, when only its host is known
ACCESS_LOG_PORT = 9001
#: the fluentd release port (``serve --fluentd-listen``) on the ``--authz`` host, by default
FLUENTD_PORT = 9004
#: ``buffer_size_bytes`` per ms of ``buffer_flush_interval`` (16 KiB for 20 ms): about what
#: 2,000 finished requests a second write in that time, so below that rate the interval
#: decides when a batch goes and above it the size does (docs/limiters.md).
ACCESS_LOG_BYTES_PER_MS = 16384 / 20
#: the shipped configs' ``buffer_flush_interval`` in ms (and ``buffer_size_bytes`` to match:
#: a message every 5 ms or 4 KiB), chosen by measurement (``python -m bench.accesslog_flush``;
#: docs/limiters.md "Access-log batching").
SHIPPED_ACCESS_LOG_FLUSH_MS = 5
#: an entry for each request still in flight this often (``access_log_flush_interval``), where
#: the policy has a ``fleet_usage`` limiter: one that Envoy let through unchecked is counted by
#: the fleet from its first such entry to its last (docs/limiters.md "Unchecked requests")
UNCHECKED_FLUSH = "1s"
#: the filter names the variants and the tests look for (and :data:`EXT_AUTHZ_FILTER`)
GRPC_ACCESS_LOGGER = "envoy.access_loggers.http_grpc"
LOCAL_RATELIMIT_FILTER = "envoy.filters.http.local_ratelimit"
#: the quick start's demo routes: (name, path prefix, POST only, tier); policies/ classifies the rest
QUICKSTART_TIERS = (("charges_post", "/v1/charges", True, "critical"), ("refunds", "/v1/refunds", False, "critical"),
                    ("reports", "/v1/reports", False, "get"))
#: the demo route whose tier travels in the Check call's context_extensions (gRPC)
QUICKSTART_EXT = ("ext", "/v1/ext/", "post")
UPSTREAM_CLUSTER = "upstream"


@dataclass(frozen=True)
class JwtProvider:
    """The token issuer ``jwt_authn`` verifies against: its ``iss``, the accepted ``aud``
    values (none: any), and its JWKS as JSON text (inlined: ``local_jwks``)."""

    issuer: str
    audiences: tuple[str, ...]
    jwks: str


@dataclass(frozen=True)
class LocalRateLimit:
    """Envoy's own token bucket (``envoy.filters.http.local_ratelimit``), first in the chain:
    the in-proxy reference the benchmarks compare with."""

    max_tokens: int
    tokens_per_fill: int | None = None  # None: max_tokens
    fill_interval: str | float = "1s"  # a number: seconds

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> LocalRateLimit:
        """From ``{"max_tokens": N, "tokens_per_fill": N, "fill_interval": "1s"}`` (a
        benchmark's or test's settings), refusing unknown keys."""
        unknown = set(settings) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"local_ratelimit: unknown keys {sorted(unknown)}")
        if "max_tokens" not in settings:
            raise ValueError("local_ratelimit: max_tokens is required")
        return cls(**settings)


@dataclass(frozen=True)
class Options:
    """Every choice of a bootstrap (:func:`bootstrap` takes them as keywords)."""

    protocol: str
    upstream: tuple[str, int]
    #: where Envoy reaches the server (None: the target's default port on loopback)
    authz: tuple[str, int] | None = None
    #: the access log's port (None: the Check port on gRPC, port 9001 of the authz host on HTTP;
    #: with ``access_log="fluentd"``: port 9004 of the authz host)
    access_log_to: tuple[str, int] | None = None
    listen_port: int = 10000
    admin_port: int = 9901
    tls: TlsFiles | None = None
    access_log: str = "auto"
    tracing: tuple[str, int] | None = None
    quickstart_routes: bool = False
    jwt: JwtProvider | None = None
    check_budget_ms: float = CHECK_BUDGET_MS
    # ---- test and benchmark variants (``envoy-config`` never sets these) ----
    #: False: no ext_authz filter, no per-route settings for it, no gRPC access log (Envoy alone)
    ext_authz: bool = True
    #: N endpoints in the server's cluster: ports ``authz[1]`` to ``authz[1] + N - 1``, the ports
    #: of ``extauthz serve --workers N --worker-ports`` (Envoy spreads its calls over them)
    authz_endpoints: int = 1
    #: the request headers the filter sends the server, instead of what the policy reads
    allowed_headers: tuple[str, ...] | None = None
    #: no ``allowed_headers`` at all: every request header goes into each CheckRequest (gRPC)
    send_all_headers: bool = False
    #: the gRPC access log's batching: a message every this many ms (or when
    #: :data:`ACCESS_LOG_BYTES_PER_MS` times as many bytes fill); 0 sends each entry at once
    access_log_flush_ms: float = SHIPPED_ACCESS_LOG_FLUSH_MS
    local_ratelimit: LocalRateLimit | None = None
    #: Envoy answers ``200 ok`` itself instead of routing to the upstream
    direct_response: bool = False
    #: the rate limit quota filters of the policy's ``enforce: envoy`` limiters before ext_authz
    #: (:mod:`.rlqs`, docs/rlqs.md); required exactly when the policy has such limiters
    rlqs: bool = False

    def __post_init__(self) -> None:
        if self.protocol not in TARGETS:
            raise ValueError(f"protocol must be one of {', '.join(TARGETS)}, not {self.protocol!r}")
        if self.access_log not in ACCESS_LOG_MODES:
            raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, not {self.access_log!r}")
        if self.authz_endpoints < 1:
            raise ValueError(f"authz_endpoints must be at least 1, not {self.authz_endpoints}")
        if not (math.isfinite(self.access_log_flush_ms) and self.access_log_flush_ms >= 0):
            raise ValueError(f"access_log_flush_ms must be finite and not negative, not {self.access_log_flush_ms}")
        # the server's range (serve --check-budget-ms): Envoy's timeout is this plus a margin
        if not MIN_CHECK_BUDGET_MS <= self.check_budget_ms <= MAX_CHECK_BUDGET_MS:  # False for NaN
            raise ValueError(f"check_budget_ms must be a number of ms from {MIN_CHECK_BUDGET_MS:.0f} to "
                             f"{MAX_CHECK_BUDGET_MS:.0f}, not {self.check_budget_ms}")
        if self.allowed_headers is not None and self.send_all_headers:
            raise ValueError("allowed_headers and send_all_headers exclude each other")
        for port in (self.listen_port, self.admin_port):
            check_port(port)


@dataclass(frozen=True)
class Build:
    """One bootstrap being built: the policy, the options and what follows from them."""

    policy: Policy
    options: Options
    #: the server's port(s) for the target (the first, then the worker ports after it)
    authz: tuple[str, int]
    authz_more: tuple[tuple[str, int], ...]
    #: whether the gRPC access log is on, where it goes and its cluster's name
    log: bool
    log_to: tuple[str, int]
    log_cluster: str
    #: whether the log shares the target's own gRPC cluster (no cluster of its own)
    log_shared: bool


class Target(Protocol):
    """What one ``--protocol`` adds to the frame (:func:`bootstrap`)."""

    #: where Envoy reaches the server on this protocol by default
    default_authz: tuple[str, int]
    #: the target's own cluster on the server's gRPC port (the access log can share it), or None
    grpc_cluster: str | None
    #: whether the verified JWT payload reaches the server in metadata (else a header)
    carries_metadata: bool
    #: whether the server's port for it speaks (m)TLS
    tls: bool

    def filters(self, b: Build) -> list[Config]:
        """The HTTP filters before the router; the first removes the client's copies of the
        headers the server or upstream trusts (the ``jwt_authn`` filter goes right after it)."""
        ...

    def clusters(self, b: Build) -> list[Config]:
        """The clusters the filters call (the frame adds the access log's, the upstream's, ...)."""
        ...

    def manager(self, b: Build, hcm: Config, vhost: Config) -> None:
        """Anything the target sets on the connection manager or the virtual host."""
        ...

    def skip_route(self, b: Build) -> Config:
        """The ``typed_per_filter_config`` that turns the target's check off on a route."""
        ...

    def route_tier(self, b: Build, tier: str) -> Config:
        """What a quick-start route carries to name its tier."""
        ...

    def extension_route(self, b: Build, tier: str) -> Config:
        """What the quick-start route with the tier in a context extension carries."""
        ...


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


def _flush(flush_ms: float) -> Config:
    if flush_ms == 0:  # every entry at once; the interval (Envoy needs one) never waits
        return {"buffer_size_bytes": 0, "buffer_flush_interval": "0.1s"}
    return {"buffer_size_bytes": round(flush_ms * ACCESS_LOG_BYTES_PER_MS),
            "buffer_flush_interval": f"{flush_ms / 1000:.3f}s"}


_SHIPPED_FLUSH = _flush(SHIPPED_ACCESS_LOG_FLUSH_MS)


def _access_log(b: Build) -> Config:
    common: Config = {"log_name": "extauthz", "transport_api_version": "V3",
                      "grpc_service": {"envoy_grpc": {"cluster_name": b.log_cluster}},
                      **_flush(b.options.access_log_flush_ms)}
    tag = route_tier_tag(b.policy)
    if tag is not None:
        common["custom_tags"] = [tag]
    return {"name": GRPC_ACCESS_LOGGER, "typed_config": {
        "@type": typed("envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"),
        "common_config": common, "additional_request_headers_to_log": unchecked_headers(b.policy)}}


def fluentd_release_log(to: tuple[str, int]) -> tuple[Config, Config]:
    """The release path through Envoy's fluentd logger: the access log entry and its
    cluster (``extauthz_fluentd``, plain TCP to ``to``: ``serve --fluentd-listen``)."""
    logger: Config = {"name": "envoy.access_loggers.fluentd", "typed_config": {
        "@type": typed("envoy.extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig"),
        "cluster": "extauthz_fluentd", "tag": FLUENTD_TAG, "stat_prefix": "extauthz_release",
        **_SHIPPED_FLUSH, "record": dict(FLUENTD_RECORD)}}
    return logger, cluster("extauthz_fluentd", to, CONNECT_TIMEOUT)


def _jwt_authn(provider: JwtProvider, in_metadata: bool) -> Config:
    """Verify a token when there is one (a bad one: 401 from Envoy); without one, pass on."""
    verified: Config = {"issuer": provider.issuer}
    if provider.audiences:
        verified["audiences"] = list(provider.audiences)
    verified.update({"local_jwks": {"inline_string": provider.jwks},
                     "forward": True,  # the Authorization header still reaches the upstream
                     "payload_in_metadata": "payload"})
    if not in_metadata:  # the HTTP protocol carries no metadata: the payload travels in a header
        verified["forward_payload_header"] = JWT_PAYLOAD_HEADER
    return {"name": JWT_NAMESPACE, "typed_config": {
        "@type": typed("envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"),
        "providers": {"issuer": verified},
        "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
            {"provider_name": "issuer"}, {"allow_missing": {}}]}}}]}}


def _local_ratelimit(limit: LocalRateLimit) -> Config:
    fill = limit.fill_interval
    everyone = {"numerator": 100, "denominator": "HUNDRED"}
    return {"name": LOCAL_RATELIMIT_FILTER, "typed_config": {
        "@type": typed("envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"),
        "stat_prefix": "local_ratelimit",
        "token_bucket": {"max_tokens": limit.max_tokens,
                         "tokens_per_fill": limit.tokens_per_fill or limit.max_tokens,
                         "fill_interval": f"{fill}s" if isinstance(fill, int | float) else fill},
        # Both default to 0 %: without them the filter neither counts nor limits.
        "filter_enabled": {"runtime_key": "local_ratelimit_enabled", "default_value": everyone},
        "filter_enforced": {"runtime_key": "local_ratelimit_enforced", "default_value": everyone},
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03"}}


def _tracing(cluster_name: str) -> Config:
    return {"random_sampling": {"value": 100}, "provider": {
        "name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": typed("envoy.config.trace.v3.OpenTelemetryConfig"),
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster_name}, "timeout": CONNECT_TIMEOUT},
            "service_name": "envoy"}}}


def _to_upstream(b: Build) -> Config:
    if b.options.direct_response:
        return {"direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
    return {"route": {"cluster": UPSTREAM_CLUSTER}}


def _quickstart_routes(target: Target, b: Build) -> list[Config]:
    """The quick start's demo routes: tiers by route and by context extension, then the
    untagged /v1/."""
    routes: list[Config] = []
    for name, prefix, post_only, tier in QUICKSTART_TIERS:
        match: Config = {"prefix": prefix}
        if post_only:
            match["headers"] = [{"name": ":method", "string_match": {"exact": "POST"}}]
        routes.append({"name": name, "match": match, **_to_upstream(b), **target.route_tier(b, tier)})
    name, prefix, tier = QUICKSTART_EXT
    routes.append({"name": name, "match": {"prefix": prefix}, **_to_upstream(b), **target.extension_route(b, tier)})
    routes.append({"name": "v1", "match": {"prefix": "/v1/"}, **_to_upstream(b)})
    return routes


def _routes(target: Target, b: Build) -> list[Config]:
    healthz: Config = {"name": "healthz", "match": {"path": "/healthz"},
                       "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}
    skip = target.skip_route(b)
    if skip:
        healthz["typed_per_filter_config"] = skip
    return [healthz, *(_quickstart_routes(target, b) if b.options.quickstart_routes else []),
            {"name": "default", "match": {"prefix": "/"}, **_to_upstream(b)}]


def _build(policy: Policy, options: Options, target: Target) -> Build:
    o = options
    authz = o.authz or target.default_authz
    more = tuple((authz[0], authz[1] + i) for i in range(1, o.authz_endpoints))
    # the access log's gRPC port: by default the target's own gRPC port, else port 9001 of its host
    log_to = o.access_log_to or (authz if target.grpc_cluster else (authz[0], ACCESS_LOG_PORT))
    # one cluster for the check and the access log when they share a port
    shared = target.grpc_cluster is not None and log_to == authz
    log_cluster = (target.grpc_cluster if shared else
                   "extauthz_access_log" if target.grpc_cluster == "extauthz" else "extauthz")
    log = o.ext_authz and (o.access_log == "always" or (o.access_log == "auto" and holds_leases(policy)))
    return Build(policy, o, authz, more, log, log_to, str(log_cluster), shared)


def bootstrap(policy: Policy, **options: Any) -> Config:
    """The bootstrap as a mapping for :class:`Options` ``**options`` (see the module
    docstring); the check's timeout is :func:`authz_timeout` of ``check_budget_ms``."""
    o = Options(**options)
    target = TARGETS[o.protocol]
    if o.tls is not None and not target.tls:
        raise ValueError("TLS to the server is for the gRPC protocol only (the HTTP port is plaintext)")
    enforced_in_envoy = [spec.name for spec in envoy_limiters(policy)]
    if o.rlqs and not enforced_in_envoy:
        raise ValueError("--rlqs: the policy has no limiter with enforce: envoy")
    if enforced_in_envoy and not o.rlqs:
        raise ValueError(f"the policy enforces {', '.join(enforced_in_envoy)} in Envoy: add --rlqs "
                         "(without the quota filter nothing would enforce them)")
    b = _build(policy, o, target)
    vhost: Config = {"name": "api", "domains": ["*"], "routes": _routes(target, b)}
    hcm: Config = {
        "@type": typed("envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
        "stat_prefix": "ingress_http", "codec_type": "AUTO",
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
    if o.tracing is not None:
        hcm["tracing"] = _tracing("otel_collector")
    target.manager(b, hcm, vhost)
    filters = target.filters(b)
    if o.jwt is not None:  # right after the strip filter: what it verifies, nobody else can set
        filters.insert(1, _jwt_authn(o.jwt, target.carries_metadata))
    if o.local_ratelimit is not None:
        filters.insert(0, _local_ratelimit(o.local_ratelimit))
    # the quota stream goes to the gRPC port: the target's gRPC cluster, else port 9001 of its host
    rlqs_cluster = target.grpc_cluster or "extauthz_rlqs"
    if o.rlqs:  # before ext_authz: a request Envoy refuses costs the server nothing
        at = next((i for i, f in enumerate(filters) if f["name"] == EXT_AUTHZ_FILTER), len(filters))
        filters[at:at] = quota_filters(policy, rlqs_cluster)
    # the fluentd logger and its cluster: plain TCP, by default port 9004 of the authz host
    fluentd = (fluentd_release_log(o.access_log_to or (b.authz[0], FLUENTD_PORT))
               if o.access_log == "fluentd" else None)
    if b.log:
        hcm["access_log"] = [_access_log(b)]
        if any(isinstance(spec, FleetUsageSpec) for spec in policy.limiters):
            hcm["access_log_options"] = {"access_log_flush_interval": UNCHECKED_FLUSH}
    elif fluentd is not None:
        hcm["access_log"] = [fluentd[0]]
    hcm["route_config"] = {"name": "local_route", "virtual_hosts": [vhost]}
    hcm["http_filters"] = [*filters, {"name": "envoy.filters.http.router", "typed_config": {
        "@type": typed("envoy.extensions.filters.http.router.v3.Router")}}]

    clusters = target.clusters(b)
    if b.log and not b.log_shared:
        clusters.append(grpc_cluster(b.log_cluster, b.log_to, o.tls))
    if fluentd is not None:
        clusters.append(fluentd[1])
    if o.rlqs and target.grpc_cluster is None:
        clusters.append(grpc_cluster(rlqs_cluster, (b.authz[0], ACCESS_LOG_PORT), None))
    clusters.append(cluster(UPSTREAM_CLUSTER, o.upstream, "1s"))
    if o.tracing is not None:
        clusters.append(cluster("otel_collector", o.tracing, CONNECT_TIMEOUT, typed_extension_protocol_options=http2()))
    return {
        "admin": {"address": address("127.0.0.1", o.admin_port)},
        "static_resources": {
            "listeners": [{"name": "ingress", "address": address("127.0.0.1", o.listen_port),
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }


def render(policy: Policy, **options: Any) -> str:
    """:func:`bootstrap` as YAML."""
    return yaml.safe_dump(bootstrap(policy, **options), sort_keys=False)


#: the protocol targets by ``--protocol`` name: a new one is a module with a :class:`Target`
#: and its line here
TARGETS: dict[str, Target] = {"grpc": GRPC, "http": HTTP}
#: where Envoy reaches the server, by protocol (``extauthz k8s`` names the same ports)
DEFAULT_AUTHZ = {name: target.default_authz for name, target in TARGETS.items()}
