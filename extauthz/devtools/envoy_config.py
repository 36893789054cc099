"""Load, render and check the project's Envoy configs (``envoy/*.yaml``).

``envoy/`` at the repository root is the one copy of the configs: the wheel ships it as the
``extauthz/envoy/configs/`` data directory (``package-dir`` in pyproject.toml), and a source
checkout reads it in place. :func:`render_config` rewrites ports and endpoints by cluster name;
:func:`validate` runs ``envoy --mode validate`` plus the cluster-reference check that Envoy
itself does not make.
"""

from __future__ import annotations

import ipaddress
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .envoy_process import EnvoyError, find_envoy

__all__ = [
    "ACCESS_LOG_BYTES_PER_MS",
    "EXT_AUTHZ_FILTER",
    "GRPC_CONFIGS",
    "HTTP_CONFIG",
    "LOCAL_RATELIMIT_FILTER",
    "SHIPPED_ACCESS_LOG_FLUSH_MS",
    "EnvoyConfigError",
    "config_path",
    "grpc_cluster_problems",
    "load_config_text",
    "render_config",
    "validate",
]

EXT_AUTHZ_FILTER = "envoy.filters.http.ext_authz"
GRPC_ACCESS_LOGGER = "envoy.access_loggers.http_grpc"
LOCAL_RATELIMIT_FILTER = "envoy.filters.http.local_ratelimit"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
UPSTREAM_CLUSTER = "upstream"
DEFAULT_CONFIG = "envoy.yaml"
#: the same proxy on Envoy's HTTP authorization protocol (``extauthz demo --protocol http``).
HTTP_CONFIG = "envoy-http.yaml"
#: the shipped configs on the gRPC protocol (their ``allowed_headers`` come from
#: ``extauthz envoy-allowed-headers --protocol grpc``). ``istio-like.yaml`` is not one of
#: them: it is what istiod generates, and istiod sets no ``allowed_headers`` for a gRPC provider.
GRPC_CONFIGS = (DEFAULT_CONFIG, "envoy-tls.yaml", "envoy-jwt.yaml")

_TYPE_PREFIX = "type.googleapis.com/"
#: ``buffer_size_bytes`` per ms of ``buffer_flush_interval`` (16 KiB for 20 ms): about what
#: 2,000 finished requests a second write in that time, so below that rate the interval
#: decides when a batch goes and above it the size does (docs/limiters.md).
ACCESS_LOG_BYTES_PER_MS = 16384 / 20
#: the shipped configs' ``buffer_flush_interval`` in ms (and ``buffer_size_bytes`` to match),
#: chosen by measurement (``python -m bench.accesslog_flush``; docs/limiters.md).
SHIPPED_ACCESS_LOG_FLUSH_MS = 5
_LOCAL_RATELIMIT_KEYS = frozenset({"max_tokens", "tokens_per_fill", "fill_interval"})

Config = dict[str, Any]


class EnvoyConfigError(EnvoyError):
    """A config failed ``envoy --mode validate`` or the cluster-reference check."""


# ---- locating files -------------------------------------------------------------------


def config_path(name: str = DEFAULT_CONFIG) -> Path:
    """The shipped config ``name`` (``envoy/<name>``): the wheel's copy, else the checkout's."""
    shipped = resources.files("extauthz").joinpath("envoy").joinpath("configs").joinpath(name)
    if shipped.is_file():  # installed from a wheel: extauthz/envoy/configs/ is package data
        return Path(str(shipped))
    # A source checkout (an editable install maps extauthz.envoy.configs to the top-level envoy/,
    # which importlib cannot resolve for a data-only directory): read envoy/ in place.
    root = Path(__file__).resolve().parents[2]
    candidate = root / "envoy" / name
    if candidate.is_file() and (root / "pyproject.toml").is_file():
        return candidate
    raise FileNotFoundError(f"no Envoy config {name!r} in the extauthz package or {root / 'envoy'}")


def load_config_text(base: Path | None = None) -> str:
    """The text of ``base``, or of the default config (see :func:`config_path`)."""
    return Path(base if base is not None else config_path()).read_text(encoding="utf-8")


# ---- rendering ------------------------------------------------------------------------


def render_config(
    base: Path | None = None,
    *,
    listen_port: int,
    admin_port: int,
    extauthz: tuple[str, int],
    upstream: tuple[str, int],
    otel: tuple[str, int] | None = None,
    extauthz_http: tuple[str, int] | None = None,
    access_log_enabled: bool = True,
    ext_authz_enabled: bool = True,
    tracing_enabled: bool = True,
    local_ratelimit: Mapping[str, Any] | None = None,
    direct_response_upstream: bool = False,
    access_log_flush_ms: float | None = None,
    extauthz_endpoints: int = 1,
    allowed_headers: Sequence[str] | None = None,
    send_all_headers: bool = False,
    fluentd: tuple[str, int] | None = None,
) -> str:
    """Return the config in ``base`` (default: the shipped one) with ports and endpoints set.

    Port 0 lets the OS pick the listener/admin ports; :class:`EnvoyProcess` discovers them.
    Clusters are addressed by name (``extauthz``, ``upstream``, ``otel_collector``, and
    ``extauthz_http`` when ``extauthz_http`` is given); ``otel``
    None keeps the collector endpoint of ``base``.

    Variants (benchmarks and tests):
      ``access_log_enabled=False``  drop the gRPC access log (the "request finished" stream).
      ``ext_authz_enabled=False``   drop the ext_authz filter, its per-route settings and the
                                    gRPC access log (both talk to the ``extauthz`` cluster).
      ``tracing_enabled=False``     drop HCM tracing.
      ``local_ratelimit``           add Envoy's own token bucket first in the filter chain:
                                    ``{"max_tokens": N, "tokens_per_fill": N (default
                                    max_tokens), "fill_interval": "1s" (default)}``.
      ``direct_response_upstream``  answer ``200 ok`` from Envoy instead of routing to the
                                    ``upstream`` cluster.
      ``access_log_flush_ms``       buffer the gRPC access log: Envoy sends a batch of entries
                                    per message every this many ms (or when
                                    ``ACCESS_LOG_BYTES_PER_MS`` times as many bytes fill) instead
                                    of one per request; 0 sends each entry at once (shipped:
                                    ``SHIPPED_ACCESS_LOG_FLUSH_MS``).
      ``extauthz_endpoints``        list N endpoints in the ``extauthz`` cluster: ports
                                    ``extauthz[1]`` to ``extauthz[1] + N - 1`` on the same host,
                                    the ports of ``extauthz serve --workers N --worker-ports``
                                    (Envoy then spreads its connections and Checks over them).
      ``allowed_headers``           the request headers the ext_authz filter sends the server
                                    (replaces the list in ``base``; see
                                    ``extauthz envoy-allowed-headers``).
      ``send_all_headers``          drop the gRPC filter's ``allowed_headers``: every request
                                    header goes into each CheckRequest (benchmarks compare).
      ``fluentd``                   the release path through Envoy's fluentd access logger to
                                    this address (``serve --fluentd-listen``) instead of the
                                    gRPC access log: the logger and cluster that
                                    ``extauthz envoy-config --access-log fluentd`` renders.
    """
    config: Config = yaml.safe_load(load_config_text(base))
    _set_port(config["admin"]["address"], admin_port)
    _set_port(_single_listener(config)["address"], listen_port)
    if extauthz_endpoints < 1:
        raise ValueError(f"extauthz_endpoints must be at least 1, not {extauthz_endpoints}")
    host, port = extauthz
    _set_cluster_endpoints(config, "extauthz", [(host, port + i) for i in range(extauthz_endpoints)])
    _set_cluster_endpoint(config, UPSTREAM_CLUSTER, upstream)
    if otel is not None:
        _set_cluster_endpoint(config, "otel_collector", otel)
    if extauthz_http is not None:  # the HTTP authorization port (envoy-http.yaml)
        _set_cluster_endpoint(config, "extauthz_http", extauthz_http)

    hcm = _http_connection_manager(config)
    if not access_log_enabled or not ext_authz_enabled:
        hcm["access_log"] = [
            a for a in hcm.get("access_log", []) if a.get("name") != GRPC_ACCESS_LOGGER
        ]
        if not hcm["access_log"]:
            del hcm["access_log"]
    if not ext_authz_enabled:
        hcm["http_filters"] = [
            f for f in hcm["http_filters"] if f.get("name") != EXT_AUTHZ_FILTER
        ]
        for holder in _per_filter_config_holders(hcm):
            per_filter = holder["typed_per_filter_config"]
            per_filter.pop(EXT_AUTHZ_FILTER, None)
            if not per_filter:
                del holder["typed_per_filter_config"]
    if access_log_flush_ms is not None:
        _set_access_log_flush(hcm, access_log_flush_ms)
    if fluentd is not None:
        from ..envoy_bootstrap import fluentd_release_log

        logger, cluster = fluentd_release_log(fluentd)
        hcm["access_log"] = [a for a in hcm.get("access_log", []) if a.get("name") != GRPC_ACCESS_LOGGER]
        hcm["access_log"].append(logger)
        config["static_resources"]["clusters"].append(cluster)
    if allowed_headers is not None or send_all_headers:
        _set_allowed_headers(hcm, allowed_headers, send_all_headers)
    if not tracing_enabled:
        hcm.pop("tracing", None)
    if local_ratelimit is not None:
        hcm["http_filters"].insert(0, _local_ratelimit_filter(local_ratelimit))
    if direct_response_upstream:
        for route in _routes(hcm):
            if route.get("route", {}).get("cluster") == UPSTREAM_CLUSTER:
                del route["route"]
                route["direct_response"] = {
                    "status": 200,
                    "body": {"inline_string": "ok"},
                }
    return yaml.safe_dump(config, sort_keys=False)


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")


def _set_port(address: Config, port: int) -> None:
    _check_port(port)
    address["socket_address"]["port_value"] = port


def _single_listener(config: Config) -> Config:
    listeners: list[Config] = config["static_resources"]["listeners"]
    if len(listeners) != 1:
        raise ValueError(f"expected exactly one listener, found {len(listeners)}")
    return listeners[0]


def _cluster(config: Config, name: str) -> Config:
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == name:
            return cluster  # type: ignore[no-any-return]
    raise ValueError(f"no cluster named {name!r} in the config")


def _set_cluster_endpoint(config: Config, name: str, endpoint: tuple[str, int]) -> None:
    _set_cluster_endpoints(config, name, [endpoint])


def _set_cluster_endpoints(config: Config, name: str, endpoints: Sequence[tuple[str, int]]) -> None:
    """Cluster ``name`` lists ``endpoints`` (all host names or all IP addresses)."""
    cluster = _cluster(config, name)
    try:
        for host, _ in endpoints:
            ipaddress.ip_address(host)
    except ValueError:  # a host name: let Envoy resolve it
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    else:
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
    lb_endpoints = []
    for host, port in endpoints:
        _check_port(port)
        address = {"socket_address": {"address": host, "port_value": port}}
        lb_endpoints.append({"endpoint": {"address": address}})
    cluster["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def _set_access_log_flush(hcm: Config, flush_ms: float) -> None:
    if flush_ms < 0:
        raise ValueError(f"access_log_flush_ms must not be negative, not {flush_ms}")
    for log_config in hcm.get("access_log", []):
        common = log_config.get("typed_config", {}).get("common_config")
        if common is None:
            continue
        if flush_ms == 0:  # every entry at once; the interval (Envoy needs one) never waits
            common["buffer_size_bytes"] = 0
            common["buffer_flush_interval"] = "0.1s"
        else:
            common["buffer_size_bytes"] = round(flush_ms * ACCESS_LOG_BYTES_PER_MS)
            common["buffer_flush_interval"] = f"{flush_ms / 1000:.3f}s"


def _set_allowed_headers(hcm: Config, names: Sequence[str] | None, send_all: bool) -> None:
    if names is not None and send_all:
        raise ValueError("allowed_headers and send_all_headers exclude each other")
    for ext_authz in [f["typed_config"] for f in hcm["http_filters"] if f.get("name") == EXT_AUTHZ_FILTER]:
        _set_filter_allowed_headers(ext_authz, names, send_all)


def _set_filter_allowed_headers(ext_authz: Config, names: Sequence[str] | None, send_all: bool) -> None:
    if send_all:
        if "grpc_service" not in ext_authz:
            raise ValueError("send_all_headers: only the gRPC protocol sends unlisted headers")
        ext_authz.pop("allowed_headers", None)
        return
    ext_authz["allowed_headers"] = {"patterns": [{"exact": name} for name in names or ()]}


def _http_connection_manager(config: Config) -> Config:
    for chain in _single_listener(config)["filter_chains"]:
        for network_filter in chain["filters"]:
            if network_filter["name"] == HCM_FILTER:
                return network_filter["typed_config"]  # type: ignore[no-any-return]
    raise ValueError("the listener has no HTTP connection manager")


def _routes(hcm: Config) -> Iterator[Config]:
    for vhost in hcm["route_config"]["virtual_hosts"]:
        yield from vhost.get("routes", [])


def _per_filter_config_holders(hcm: Config) -> Iterator[Config]:
    for vhost in hcm["route_config"]["virtual_hosts"]:
        if "typed_per_filter_config" in vhost:
            yield vhost
        for route in vhost.get("routes", []):
            if "typed_per_filter_config" in route:
                yield route


def _local_ratelimit_filter(settings: Mapping[str, Any]) -> Config:
    unknown = set(settings) - _LOCAL_RATELIMIT_KEYS
    if unknown:
        raise ValueError(f"local_ratelimit: unknown keys {sorted(unknown)}")
    if "max_tokens" not in settings:
        raise ValueError("local_ratelimit: max_tokens is required")
    max_tokens = int(settings["max_tokens"])
    fill_interval = settings.get("fill_interval", "1s")
    if isinstance(fill_interval, int | float):
        fill_interval = f"{fill_interval}s"
    everyone = {"numerator": 100, "denominator": "HUNDRED"}
    return {
        "name": LOCAL_RATELIMIT_FILTER,
        "typed_config": {
            "@type": _TYPE_PREFIX
            + "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "local_ratelimit",
            "token_bucket": {
                "max_tokens": max_tokens,
                "tokens_per_fill": int(settings.get("tokens_per_fill", max_tokens)),
                "fill_interval": str(fill_interval),
            },
            # Both default to 0 %: without them the filter neither counts nor limits.
            "filter_enabled": {
                "runtime_key": "local_ratelimit_enabled",
                "default_value": everyone,
            },
            "filter_enforced": {
                "runtime_key": "local_ratelimit_enforced",
                "default_value": everyone,
            },
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        },
    }


# ---- validation -----------------------------------------------------------------------


def grpc_cluster_problems(config: str | Mapping[str, Any]) -> list[str]:
    """Every ``envoy_grpc.cluster_name`` that names no static cluster, with its dotted path.

    ``envoy --mode validate`` does not catch these (ext_authz, access log, tracer): Envoy only
    fails them at run time, so a typo silently turns into fail-open or lost log entries.
    """
    data = yaml.safe_load(config) if isinstance(config, str) else config
    clusters = {
        c.get("name") for c in data.get("static_resources", {}).get("clusters", [])
    }
    problems = []
    for path, node in _walk(data, ""):
        grpc = node.get("envoy_grpc")
        if isinstance(grpc, Mapping):
            name = grpc.get("cluster_name")
            if name not in clusters:
                problems.append(
                    f"{path}.envoy_grpc.cluster_name: {name!r} names no defined cluster "
                    f"(defined: {', '.join(sorted(str(c) for c in clusters))})"
                )
    return problems


def _walk(node: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if isinstance(node, Mapping):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def validate(
    config_text: str, *, envoy_binary: str | None = None, timeout: float = 30.0
) -> None:
    """Run ``envoy --mode validate`` and the cluster-reference check; raise on any problem."""
    binary = envoy_binary or find_envoy()
    with tempfile.TemporaryDirectory(prefix="extauthz-envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(config_text, encoding="utf-8")
        result = subprocess.run(
            [binary, "--mode", "validate", "-c", str(path), "--log-level", "error"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise EnvoyConfigError(
            f"envoy --mode validate failed (exit {result.returncode}):\n{output}"
        )
    problems = grpc_cluster_problems(config_text)
    if problems:
        raise EnvoyConfigError("undefined gRPC clusters:\n" + "\n".join(problems))


