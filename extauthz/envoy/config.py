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
from typing import Any

import yaml

from ..policy.model import Policy
from ..policy.schema import ConcurrentRequestsSpec, FleetUsageSpec, WorkerUtilizationSpec
from .blocks import (
    CONNECT_TIMEOUT,
    HEALTHZ_PATH,
    Config,
    TlsFiles,
    address,
    authz_timeout,
    client_manager,
    cluster,
    grpc_cluster,
    http2,
    router,
    typed,
)
from .ext_authz import EXT_AUTHZ_FILTER, GRPC, HTTP
from .frame import (
    ACCESS_LOG_MODES,
    SHIPPED_ACCESS_LOG_FLUSH_MS,
    Build,
    JwtProvider,
    LocalRateLimit,
    Options,
    Target,
)
from .headers import JWT_NAMESPACE, JWT_PAYLOAD_HEADER
from .records import FLUENTD_RECORD, FLUENTD_TAG, route_tier_tag, unchecked_headers
from .rlqs import envoy_limiters, envoy_shedders, quota_filters

__all__ = ["ACCESS_LOG_BYTES_PER_MS", "ACCESS_LOG_MODES", "DEFAULT_AUTHZ", "EXT_AUTHZ_FILTER", "GRPC_ACCESS_LOGGER",
           "LOCAL_RATELIMIT_FILTER", "SHIPPED_ACCESS_LOG_FLUSH_MS", "TARGETS", "Build", "JwtProvider",
           "LocalRateLimit", "Options", "Target", "TlsFiles", "authz_timeout", "bootstrap", "fluentd_release_log",
           "holds_leases", "jwks_from_file", "render"]

#: the gRPC port that receives the access log, when only its host is known
ACCESS_LOG_PORT = 9001
#: the fluentd release port (``serve --fluentd-listen``) on the ``--authz`` host, by default
FLUENTD_PORT = 9004
#: ``buffer_size_bytes`` per ms of ``buffer_flush_interval`` (16 KiB for 20 ms): about what
#: 2,000 finished requests a second write in that time, so below that rate the interval
#: decides when a batch goes and above it the size does (docs/limiters.md).
ACCESS_LOG_BYTES_PER_MS = 16384 / 20
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
    healthz: Config = {"name": "healthz", "match": {"path": HEALTHZ_PATH},
                       "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}
    skip = target.skip_route(b)
    if skip:
        healthz["typed_per_filter_config"] = skip
    return [healthz, *(_quickstart_routes(target, b) if b.options.quickstart_routes else []),
            {"name": "default", "match": {"prefix": "/"}, **_to_upstream(b)}]


def _build(policy: Policy, options: Options, target: Target) -> Build:
    o = options
    authz = o.authz or target.default_authz
    more = tuple((authz[0], authz[1] + i) for i in range(1, o.authz_endpoints)) + o.authz_more
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
    protocol = options.get("protocol")
    if protocol not in TARGETS:
        raise ValueError(f"protocol must be one of {', '.join(TARGETS)}, not {protocol!r}")
    o = Options(**options)
    target = TARGETS[o.protocol]
    if o.authz_more and target.grpc_cluster is None:
        raise ValueError("several --authz are for --protocol grpc (its one cluster carries the checks, the "
                         "access log and the quota stream)")
    if o.tls is not None and not target.tls:
        raise ValueError("TLS to the server is for the gRPC protocol only (the HTTP port is plaintext)")
    enforced_in_envoy = [spec.name for spec in envoy_limiters(policy)]
    if o.rlqs and not enforced_in_envoy and not envoy_shedders(policy):
        raise ValueError("--rlqs: the policy has no limiter with enforce: envoy (nor a shedder with envoy_deny_all)")
    if enforced_in_envoy and not o.rlqs:
        raise ValueError(f"the policy enforces {', '.join(enforced_in_envoy)} in Envoy: add --rlqs "
                         "(without the quota filter nothing would enforce them)")
    pushed = [spec.name for spec in envoy_shedders(policy)]
    if o.rlqs and pushed and o.quickstart_routes:
        # their tiers travel in route metadata and context extensions, which the quota filter's
        # matchers cannot read: POST /v1/charges, critical in the check, would be Envoy's post
        raise ValueError(f"--quickstart-routes with --rlqs: the shedder {pushed[0]} pushes DENY_ALL to Envoy, "
                         "whose quota filter cannot read the routes' tiers (route metadata, context "
                         "extensions): their critical traffic would be refused as post (docs/rlqs.md)")
    b = _build(policy, o, target)
    vhost: Config = {"name": "api", "domains": ["*"], "routes": _routes(target, b)}
    hcm = client_manager()  # client-facing (blocks.py)
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
    hcm["http_filters"] = [*filters, router()]

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
