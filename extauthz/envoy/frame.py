"""What one bootstrap is built from: its :class:`Options` (every choice, checked), the
:class:`Build` that follows from them and a policy, and the :class:`Target` protocol a
``--protocol`` module implements. Below :mod:`.config` (the generator) and the targets
(:mod:`.ext_authz`), which both read these types: neither imports the other's module for them.
The protocol name itself is checked against the registry by :func:`.config.bootstrap`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ..core.settings import CHECK_BUDGET_MS, MAX_CHECK_BUDGET_MS, MIN_CHECK_BUDGET_MS
from ..policy.model import Policy
from .blocks import Config, TlsFiles, check_port, is_ip

__all__ = ["ACCESS_LOG_MODES", "SHIPPED_ACCESS_LOG_FLUSH_MS", "Build", "JwtProvider", "LocalRateLimit",
           "Options", "Target"]

#: auto stays the gRPC stream: the fluentd port is off unless ``serve --fluentd-listen`` is
#: given, is plaintext, and Envoy still calls its logger young (docs/envoy.md)
ACCESS_LOG_MODES = ("auto", "always", "never", "fluentd")
#: the shipped configs' ``buffer_flush_interval`` in ms (and ``buffer_size_bytes`` to match:
#: a message every 5 ms or 4 KiB), chosen by measurement (``python -m bench.accesslog_flush``;
#: docs/limiters.md "Access-log batching").
SHIPPED_ACCESS_LOG_FLUSH_MS = 5
#: the most server endpoints (``--authz`` repeated, or ``authz_endpoints``) one cluster lists
MAX_AUTHZ_ENDPOINTS = 64


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


@dataclass(frozen=True)
class Options:
    """Every choice of a bootstrap (:func:`bootstrap` takes them as keywords)."""

    protocol: str
    upstream: tuple[str, int]
    #: where Envoy reaches the server (None: the target's default port on loopback)
    authz: tuple[str, int] | None = None
    #: more replicas in the server's cluster beside ``authz`` (gRPC: its one cluster carries the
    #: checks, the access log and the quota stream, which Envoy opens again on another
    #: endpoint when its replica goes; docs/rlqs.md), all addresses or all host names
    authz_more: tuple[tuple[str, int], ...] = ()
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

    def _more_endpoints(self) -> None:
        """``authz_more`` checked: beside ``authz`` (not ``authz_endpoints``), at most
        :data:`MAX_AUTHZ_ENDPOINTS` in all, each once, ports 1-65535, all addresses or all host
        names (one cluster type); with TLS one server name for all (the cluster verifies every
        endpoint's certificate against the first one's host name: another name would fail the
        handshake, and that replica's checks fail open)."""
        if self.authz is None or self.authz_endpoints > 1:
            raise ValueError("more server endpoints need the first one (authz), and not authz_endpoints")
        endpoints = (self.authz, *self.authz_more)
        if len(endpoints) > MAX_AUTHZ_ENDPOINTS:
            raise ValueError(f"at most {MAX_AUTHZ_ENDPOINTS} server endpoints (--authz), not {len(endpoints)}")
        for host, port in endpoints:
            if not host or not 0 < port < 65536:
                raise ValueError(f"a server endpoint is HOST:PORT with a port in 1-65535, not {host}:{port}")
        seen: set[tuple[str, int]] = set()
        for endpoint in endpoints:
            if endpoint in seen:
                raise ValueError(f"the server endpoint {endpoint[0]}:{endpoint[1]} is given twice")
            seen.add(endpoint)
        if len({is_ip(h) for h, _ in endpoints}) > 1:
            raise ValueError("the server's endpoints are all addresses or all host names (one cluster type)")
        names = sorted({h for h, _ in endpoints if not is_ip(h)})
        if self.tls is not None and len(names) > 1:
            raise ValueError(f"with TLS the server's endpoints share one host name (the certificate each must "
                             f"show, checked as {self.authz[0]!r}), not {', '.join(names)}: give one name that "
                             "resolves to every replica, or their addresses (checked as their shared name)")

    def __post_init__(self) -> None:
        if self.access_log not in ACCESS_LOG_MODES:
            raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, not {self.access_log!r}")
        if not 1 <= self.authz_endpoints <= MAX_AUTHZ_ENDPOINTS:
            raise ValueError(f"authz_endpoints must be 1-{MAX_AUTHZ_ENDPOINTS}, not {self.authz_endpoints}")
        if self.authz_more:
            self._more_endpoints()
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
