"""``extauthz envoy-config --protocol ratelimit``: an Envoy bootstrap whose global rate limit
filter (``envoy.filters.http.ratelimit``) calls ShouldRateLimit on the server's gRPC port.

The rate limit actions come from the policy's limiters with ``match`` (and ``unlimited``
entries) of one domain: one ``rate_limits`` entry per descriptor shape, one action per entry:
``remote_address``, ``masked_remote_address``, ``source_cluster`` and ``destination_cluster``
by their own actions, ``generic_key`` by a generic key with the match's value, ``path``,
``method`` and ``authority`` from the pseudo-headers, every other key from a request header
(``--descriptor-header KEY=HEADER``; default: the key with ``-`` for ``_``); the tier entry
(``classification.descriptor_key``, default ``tier``) by a generic key with the match's tier,
else a metadata action reading the route's tier where Check's classifier reads it. The filter fails
open (``failure_mode_deny: false``) within the server's check budget plus Envoy's margin,
as ext_authz does; ``ext_authz`` (an auth service of the team's own) can run before it. A
policy whose limiters with ``match`` take leases gets the gRPC access log that releases them
(the answer's lease metadata, filed under the filter's namespace).

The rate limit protocol's part of the Envoy config generator, on :mod:`.blocks` (a
bootstrap of its own: no ext_authz target, see :mod:`.config` for those).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from ..core.settings import CHECK_BUDGET_MS
from ..core.tiers import Tier
from ..policy.model import Policy, RouteRef
from ..policy.schema import ConcurrentRequestsSpec, DescriptorMatch, FleetUsageSpec, WorkerUtilizationSpec
from .blocks import (
    Config,
    TlsFiles,
    address,
    answering_listener,
    authz_timeout,
    client_manager,
    cluster,
    grpc_cluster,
    router,
    typed,
)
from .config import ACCESS_LOG_BYTES_PER_MS, GRPC_ACCESS_LOGGER, SHIPPED_ACCESS_LOG_FLUSH_MS

__all__ = ["DEFAULT_RLS", "RATELIMIT_FILTER", "actions_for", "bootstrap", "render"]

#: the filter's name
RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
#: where Envoy reaches ShouldRateLimit by default: the server's gRPC port
DEFAULT_RLS = ("127.0.0.1", 9001)
#: descriptor keys Envoy fills with an action of their own
_OWN_ACTIONS = {"remote_address": "remote_address", "masked_remote_address": "masked_remote_address",
                "source_cluster": "source_cluster", "destination_cluster": "destination_cluster"}
_PSEUDO = {"path": ":path", "method": ":method", "authority": ":authority"}
TIER_NAMES = tuple(t.value for t in Tier)


def domain_of(policy: Policy, domain: str | None) -> str:
    """The domain the filter sends: ``domain``, else the policy's only one."""
    domains = policy.descriptors.domains
    if domain is not None:
        if domain not in domains:
            raise ValueError(f"--domain {domain!r}: no limiter with 'match' has it "
                             f"({', '.join(sorted(domains)) or 'none has match'})")
        return domain
    if len(domains) != 1:
        raise ValueError("the policy's limiters with 'match' name "
                         + (f"{len(domains)} domains ({', '.join(sorted(domains))}): pick one with --domain"
                            if domains else "no domain: add 'match' to a request_rate or quota limiter"))
    return next(iter(domains))


def _matches(policy: Policy, domain: str) -> list[DescriptorMatch]:
    found: list[DescriptorMatch] = [m for spec in policy.limiters
                                    if (m := spec.match) is not None and m.domain == domain]
    return found


def tier_action(key: str, value: str | None, route: RouteRef) -> Config:
    """The action that sends a descriptor's tier entry ``key``: a fixed tier (``value``) by a
    generic key (a route's own ``rate_limits``), else the route's tier from its metadata (where
    the classifier reads it on Check: ``classification.route_metadata``), ``post`` when the
    route names none."""
    if value is not None:
        if value.endswith("*") or value not in TIER_NAMES:
            raise ValueError(f"the tier entry '{key}: {value}' names no tier ({', '.join(TIER_NAMES)})")
        return {"generic_key": {"descriptor_key": key, "descriptor_value": value}}
    namespace, path = route
    if not all(isinstance(step, str) for step in path):
        raise ValueError(f"the route's tier is read at a list index ({list(path)}): a rate limit "
                         "metadata action follows keys only")
    return {"metadata": {"descriptor_key": key, "source": "ROUTE_ENTRY", "default_value": Tier.POST.value,
                         "metadata_key": {"key": namespace, "path": [{"key": step} for step in path]}}}


def actions_for(match: DescriptorMatch, headers: Mapping[str, str],
                tier: tuple[str, RouteRef] | None = None) -> list[Config]:
    """The rate limit actions that build a descriptor of ``match``'s shape; ``tier``: the
    descriptor entry that names the tier and where the route's metadata names it."""
    out: list[Config] = []
    for e in match.descriptor:
        if tier is not None and e.key == tier[0]:
            out.append(tier_action(e.key, e.value, tier[1]))
        elif e.key in _OWN_ACTIONS:
            out.append({_OWN_ACTIONS[e.key]: {}})
        elif e.key == "generic_key":
            if e.value is None or e.value.endswith("*"):
                raise ValueError("a 'generic_key' entry needs its value (the action sends a fixed one)")
            out.append({"generic_key": {"descriptor_value": e.value}})
        else:
            header = headers.get(e.key) or _PSEUDO.get(e.key) or e.key.replace("_", "-")
            out.append({"request_headers": {"header_name": header, "descriptor_key": e.key}})
    return out


def holds_leases(policy: Policy, domain: str) -> bool:
    """Whether a limiter with ``match`` of ``domain`` takes leases (concurrent_requests,
    fleet_usage, worker_utilization's inflight signal): its answers' lease metadata is
    released by Envoy's access log."""
    for spec in policy.limiters:
        match = spec.match
        if match is None or match.domain != domain:
            continue
        if isinstance(spec, ConcurrentRequestsSpec | FleetUsageSpec) or (
                isinstance(spec, WorkerUtilizationSpec) and spec.signal.source == "inflight"):
            return True
    return False


def release_log() -> Config:
    """The gRPC access log to the server's AccessLogService (the ``extauthz`` cluster): a
    finished request's entry carries the ratelimit filter's metadata, the leases to release."""
    return {"name": GRPC_ACCESS_LOGGER, "typed_config": {
        "@type": typed("envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"),
        "common_config": {"log_name": "extauthz", "transport_api_version": "V3",
                          "grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"}},
                          "buffer_size_bytes": round(SHIPPED_ACCESS_LOG_FLUSH_MS * ACCESS_LOG_BYTES_PER_MS),
                          "buffer_flush_interval": f"{SHIPPED_ACCESS_LOG_FLUSH_MS / 1000:.3f}s"}}}


def rate_limits(policy: Policy, domain: str, headers: Mapping[str, str]) -> list[Config]:
    """One ``rate_limits`` entry per distinct action list, in policy order."""
    out: list[Config] = []
    tier = (policy.descriptor_tier_key, policy.route_metadata)
    for match in _matches(policy, domain):
        entry = {"actions": actions_for(match, headers, tier)}
        if entry not in out:
            out.append(entry)
    return out


def bootstrap(policy: Policy, *, upstream: tuple[str, int], authz: tuple[str, int] | None = None,
              domain: str | None = None, headers: Mapping[str, str] | None = None,
              listen_port: int = 10000, admin_port: int = 9901, tls: TlsFiles | None = None,
              ext_authz: tuple[str, int] | None = None, check_budget_ms: float = CHECK_BUDGET_MS,
              direct_upstream: bool = False) -> Config:
    """The bootstrap as a mapping (module docstring). ``direct_upstream``, a benchmark's
    variant (``envoy-config`` never sets it): the upstream is a second listener of this Envoy,
    on ``upstream``, answering ``200 ok`` itself (the filter skips a route that answers
    directly, so the route still goes to the upstream cluster)."""
    name = domain_of(policy, domain)
    limits = rate_limits(policy, name, headers or {})
    filters: list[Config] = []
    if ext_authz is not None:  # the team's own auth service keeps the ext_authz slot
        filters.append({"name": "envoy.filters.http.ext_authz", "typed_config": {
            "@type": typed("envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"),
            "grpc_service": {"envoy_grpc": {"cluster_name": "auth_service"}, "timeout": "0.25s"},
            "transport_api_version": "V3", "failure_mode_allow": False}})
    filters.append({"name": RATELIMIT_FILTER, "typed_config": {
        "@type": typed("envoy.extensions.filters.http.ratelimit.v3.RateLimit"),
        "domain": name,
        # fail open: a server that does not answer in time lets the request through
        "failure_mode_deny": False,
        "timeout": authz_timeout(check_budget_ms),
        "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"}},
                               "transport_api_version": "V3"},
    }})
    filters.append(router())
    hcm = client_manager()  # the remote_address descriptor is the client's address (blocks.py)
    hcm["route_config"] = {"name": "local_route", "virtual_hosts": [{
        "name": "api", "domains": ["*"], "rate_limits": limits,
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}]}]}
    hcm["http_filters"] = filters
    if holds_leases(policy, name):
        hcm["access_log"] = [release_log()]
    clusters = [grpc_cluster("extauthz", authz or DEFAULT_RLS, tls)]
    if ext_authz is not None:
        clusters.append(grpc_cluster("auth_service", ext_authz, None))
    clusters.append(cluster("upstream", upstream, "1s"))
    listeners = [{"name": "ingress", "address": address("127.0.0.1", listen_port),
                  "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                  "typed_config": hcm}]}]}]
    if direct_upstream:
        listeners.append(answering_listener("upstream", upstream))
    return {
        "admin": {"address": address("127.0.0.1", admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def render(policy: Policy, **options: Any) -> str:
    """:func:`bootstrap` as YAML."""
    return yaml.safe_dump(bootstrap(policy, **options), sort_keys=False)
