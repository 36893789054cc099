"""Every option of ``extauthz serve``, once: flag, environment variable, type, default, help.

:class:`Settings` is the server's whole configuration (``ServerConfig`` in
:mod:`extauthz.server.app` is this class). Each field that an operator sets is declared with
:func:`option`, which keeps its flag, its ``EXTAUTHZ_*`` variable, its parser and its help beside
its default (envoyproxy/ratelimit's ``settings.go`` is the model); :func:`add_arguments` generates
``serve``'s argparse options from those declarations and :func:`from_args` builds the one
:class:`Settings` from the parsed namespace. The few fields without a flag are declared with
:func:`internal`, which says why. ``extauthz.commands.opscli`` takes the options it shares with ``serve``
(``--redis-url``, ``--key-prefix``, ``--admin-token-file``, ``--identity-salt``) from here too
(:func:`add_shared`).

Parsers live here once: :func:`off` (``""``, ``off``, ``none`` turn a port off), :func:`size`,
:func:`positive`; durations use the policy's :func:`~extauthz.policy.schema.parse_duration`.
This module imports no server code, so ``extauthz --help`` and the operator commands stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the authorization protocols of Envoy's ext_authz filter, both answered from the same
#: pieces here (``serve --listen`` / ``--http-listen``; ``--protocol`` of
#: ``envoy-allowed-headers`` and ``demo``).
PROTOCOLS = ("grpc", "http")
#: what ``extauthz k8s --target`` renders (extauthz/commands/k8s.py); here so that the command line
#: names them without importing the renderer
K8S_TARGETS = ("envoy-gateway", "istio-sidecar", "istio-ambient")

__all__ = [
    "CHECK_BUDGET_MS", "DEFAULT_MAX_ACTIVE_CHECKS", "ENVOY_MARGIN_MS", "ENV_PREFIX", "K8S_TARGETS", "KEY_PREFIX",
    "MEMORY_MAX_KEYS", "OFF", "PROTOCOLS", "STORE_DEADLINE_MS", "WORKER_CONFIG_ENV",
    "WORKER_READY_FD_ENV", "Option", "Settings", "add_arguments", "add_shared", "env_value", "from_args", "off",
    "options", "positive", "size", "worker_env", "worker_handover",
]

#: every option's environment variable is ``EXTAUTHZ_`` + its flag, upper case, ``-`` -> ``_``
ENV_PREFIX = "EXTAUTHZ_"
#: the store's per-call deadline before failing open (ms): the engine's and the Redis store's default.
STORE_DEADLINE_MS = 5.0
#: the time a check may take from its arrival to its answer (ms): ``serve --check-budget-ms``.
CHECK_BUDGET_MS = 200.0
#: what ``envoy-config`` adds to the check budget for Envoy's ext_authz ``timeout`` (ms): the
#: network and Envoy's own turn, so that the server's answer lands before Envoy gives up.
ENVOY_MARGIN_MS = 50.0
#: the prefix of every store key (store/keys.py), the same on every replica and for the CLI.
KEY_PREFIX = "extauthz"
#: checks decided at once on the HTTP authorization port (server/http.py ``HttpLimits``).
DEFAULT_MAX_ACTIVE_CHECKS = 8
#: bound on one policy file's size (policy/loader.py), 1 MiB: a ConfigMap's limit.
POLICY_MAX_BYTES = 1 << 20
#: per-user keys one limiter holds in the embedded store (store/memory.py), the least recently
#: used forgotten past it: about 100 MiB per limiter (bench/memory_per_key.py; docs/limiters.md).
MEMORY_MAX_KEYS = 250_000
#: recent refusals each replica keeps per identity (observe/recent_refusals.py; here, where
#: the command line's help reads it without the server's modules)
RECENT_REFUSALS_PER_IDENTITY = 20

#: values of a listen option (``--listen``, ``--http-listen``, ``--admin-listen``,
#: ``--metrics-listen``, ``--health-listen``) and ``--admin-url-file`` that turn it off
OFF = ("", "off", "none")


def off(value: str | None) -> str | None:
    """None for an off value (unset or one of :data:`OFF`, any case), else ``value``."""
    return None if (value or "").strip().lower() in OFF else value


# -- parsers (argparse ``type=``: they raise ArgumentTypeError with the reason) ------------


def size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b") or "0"
    try:
        value = float(t[:-1]) * units[t[-1]] if t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes or e.g. 500M, 2G") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be positive")
    return int(value)


def positive(text: str) -> int:
    """A whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: must be at least 1")
    return value


def _milliseconds(text: str) -> float:
    """A positive, finite number of milliseconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad milliseconds {text!r}: a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"bad milliseconds {text!r}: must be positive and finite")
    return value


#: the largest check budget (ms): Envoy's timeout is rendered from it, and a minute is
#: already far beyond what any client waits for an authorization
MAX_CHECK_BUDGET_MS = 60_000.0
#: the smallest check budget (ms): a check takes a few loop turns, and the server is starved
#: from a lag of half the budget (extauthz/engine/overload.py): below it an idle loop's jitter would
#: read as starved (a store deadline longer than the budget is fine: the time left bounds it)
MIN_CHECK_BUDGET_MS = 20.0


def _budget(text: str) -> float:
    """A check budget: milliseconds from :data:`MIN_CHECK_BUDGET_MS` to :data:`MAX_CHECK_BUDGET_MS`."""
    value = _milliseconds(text)
    if value < MIN_CHECK_BUDGET_MS:
        raise argparse.ArgumentTypeError(f"bad milliseconds {text!r}: at least {MIN_CHECK_BUDGET_MS:.0f}")
    if value > MAX_CHECK_BUDGET_MS:
        raise argparse.ArgumentTypeError(f"bad milliseconds {text!r}: at most {MAX_CHECK_BUDGET_MS:.0f}")
    return value


def _fraction(text: str) -> float:
    """A number (:class:`Settings` checks the range, with its own message)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad fraction {text!r}: a number in (0, 1]") from None


def _count(text: str) -> int:
    """A whole number (``--workers``: Settings checks the range, server/workers.py the rest)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: a whole number") from None


def _flag(text: str) -> bool:
    """A boolean ``EXTAUTHZ_*`` variable: 1, true or yes (anything else is false)."""
    return text.strip().lower() in ("1", "true", "yes")


# -- declarations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """How an operator sets one :class:`Settings` field."""

    flag: str
    help: str
    #: str -> value (argparse ``type``); None: the text itself
    parse: Callable[[str], Any] | None = None
    #: "value", "switch" (a flag without a value; the variable is 1/true/yes) or
    #: "list" (one or more values; the variable is comma-separated)
    kind: str = "value"
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    #: the default as --help and the docs say it, when not the field's value
    shown: str | None = None
    #: argparse sees None when neither the flag nor the variable is given (from_args tells
    #: "not asked for" from "asked for the default": --admin-listen, --admin-url-file)
    unset_is_none: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").upper().replace("-", "_")


def option(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A field set by ``flag`` and its ``EXTAUTHZ_*`` variable."""
    meta = {"option": Option(flag, help, **kw)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def internal(default: Any, why: str) -> Any:
    """A field with no flag, and the reason it has none."""
    return field(default=default, metadata={"internal": why})


@dataclass
class Settings:
    """The configuration of one server (and, through ``workers``, of each worker process)."""

    policies: list[str] = option(  # noqa: RUF009 - option() copies a list default (default_factory)
        ["policies"], "--policies", "policy file(s) or directory", kind="list", shown="policies/")
    policy_max_bytes: int = option(
        POLICY_MAX_BYTES, "--policy-max-bytes", "bound on one policy file's size, checked before "
        "parsing; a larger file fails the start or the reload (the last good policy keeps "
        "serving)", parse=size, shown="1M, a ConfigMap's limit")
    listen: str = option(
        "0.0.0.0:9001", "--listen", "gRPC Check + AccessLog + health port; 'off' (or '') turns it off")
    grpc_server: str = option(
        "asyncio", "--grpc-server", "what serves the --listen and --health-listen ports: 'asyncio' "
        "(HTTP/2 on the event loop, server/grpc_h2.py: the same services at a fraction of the CPU "
        "per check; docs/design.md) or 'grpcio' (grpc.aio, the former default, selectable for one "
        "release)", choices=("asyncio", "grpcio"))
    #: an H2Limits or None (typed Any: the settings import no server code, not even a type)
    grpc_limits: Any = internal(  # noqa: RUF009 - internal() returns a field()
        None, "the asyncio gRPC server's protocol bounds (server/grpc_h2.py H2Limits, "
        "docs/security.md); tests shorten its timeouts")
    http_listen: str | None = option(
        None, "--http-listen", "HTTP authorization port for Envoy's http_service (and other "
        "forward-auth proxies), e.g. 0.0.0.0:9003; off unless given (docs/http.md)")
    http_header_timeout: float = internal(
        10.0, "a protocol guard against clients that never finish their headers; Envoy sends them "
        "at once, so no deployment has needed another value")
    http_max_active_checks: int = option(
        DEFAULT_MAX_ACTIVE_CHECKS, "--http-max-active-checks", "checks decided at once on the HTTP "
        "port; more wait before they start, so at saturation the store deadline measures the "
        "store, not the queue (docs/http.md)", parse=positive)
    http_max_connections: int | None = option(
        None, "--http-max-connections", "open connections on the HTTP port at once; one more is "
        "closed unanswered (docs/http.md)", parse=positive,
        shown="the file limit (ulimit -n) less a quarter (at least 128) for the other ports, "
        "Redis and files, at most 4096")
    http_forward_auth: bool = option(
        False, "--http-forward-auth", "on the HTTP port, take the client's method, path and host "
        "from X-Forwarded-Method/-Uri/-Host (Traefik ForwardAuth); never with Envoy", kind="switch")
    http_path_prefix: str = option(
        "", "--http-path-prefix", "on the HTTP port, the path prefix Envoy puts before the "
        "client's path (http_service.path_prefix; Envoy Gateway's SecurityPolicy "
        "extAuth.http.path), removed before classifying; paths without it are taken as they are",
        shown="none")
    redis_url: str | None = option(
        None, "--redis-url", "Redis store URL; without it the embedded store serves one replica")
    memory_max_keys: int = option(
        MEMORY_MAX_KEYS, "--memory-max-keys", "embedded store (no --redis-url): distinct keys "
        "(users, API keys...) each limiter holds; past it the least recently used is forgotten "
        "and counted (extauthz_store_evictions_total): a quota forgets that key's usage, a "
        "bucket refills; a key with requests in flight is kept (docs/limiters.md)",
        parse=positive, shown="250000, about 100 MiB per limiter")
    store_deadline_ms: float = option(
        STORE_DEADLINE_MS, "--store-deadline-ms", "deadline of each store call before failing open",
        parse=_milliseconds)
    check_budget_ms: float = option(
        CHECK_BUDGET_MS, "--check-budget-ms", "time a check may take from its arrival to its answer; "
        "while the server's loop lags half of it, checks are decided at once (shedders refuse "
        "non-critical tiers, reason overload) instead of Envoy timing them out, and a store call "
        "never outlives a check's time left (else its limiters fail per failure_mode, reason "
        f"overload); envoy-config renders Envoy's timeout as this plus {ENVOY_MARGIN_MS:.0f} ms; "
        f"{MIN_CHECK_BUDGET_MS:.0f} ms to {MAX_CHECK_BUDGET_MS:.0f} ms (docs/limiters.md)", parse=_budget)
    key_prefix: str = option(KEY_PREFIX, "--key-prefix", "prefix of every store key")
    identity_salt: str = option(
        "", "--identity-salt", "key for hashing identities; same on every replica")
    admin_listen: str = option(
        "127.0.0.1:9002", "--admin-listen", "admin HTTP port (status, switches); keep it private; "
        "'off' disables. Not given: 127.0.0.1:9002, or an OS-chosen port with a warning when that "
        "is taken (a second server on the host); given and taken: the start fails",
        unset_is_none=True)
    admin_listen_optional: bool = internal(
        False, "not an option: true when --admin-listen was not given (from_args), so that a "
        "taken default port falls back to an OS-chosen one")
    admin_url_file: str | None = option(
        None, "--admin-url-file", "file the server writes its admin URL to, so that `extauthz "
        "switch|report --listen HOST:PORT` reach it", unset_is_none=True,
        shown="$XDG_RUNTIME_DIR/extauthz/admin-PORT.url or /tmp/extauthz-UID/admin-PORT.url, "
        "PORT the --listen port; 'off' disables")
    admin_token_file: str | None = option(
        None, "--admin-token-file", "file holding the admin port's bearer token (or NAME:TOKEN "
        "lines, one per operator); every admin request but /healthz then needs Authorization: "
        "Bearer TOKEN and a change needs a reason. Read again when the file changes. Required "
        "when --admin-listen is not loopback")
    admin_hosts: tuple[str, ...] = option(
        (), "--admin-hosts", "Host header values the admin port answers besides loopback and its "
        "own --admin-listen address, comma-separated (e.g. a name you reach it by)")
    metrics_listen: str | None = option(
        None, "--metrics-listen", "Prometheus metrics port, e.g. 0.0.0.0:9464")
    grace_seconds: float = internal(
        5.0, "the chart's terminationGracePeriodSeconds and preStop sleep are sized on it "
        "(tests/helm); a flag would let the two disagree")
    reload_interval: float = internal(
        1.0, "policy file poll; the docs promise a change within about a second, tests shorten it")
    switch_poll_interval: float = internal(
        1.0, "kill switch poll; the docs promise every replica within about a second")
    decision_log_per_second: int = internal(
        1000, "a safety cap on decision log lines, not a tuning knob")
    reuse_port: bool = option(
        False, "--reuse-port", "let another process bind the same --listen port (SO_REUSEPORT): a "
        "new version starts beside this one, then this one gets SIGTERM and drains", kind="switch")
    tls_cert: str | None = option(
        None, "--tls-cert", "PEM certificate (chain) of the gRPC port: TLS on; needs --tls-key. "
        "Rotated files are picked up without a restart", shown="plaintext")
    tls_key: str | None = option(None, "--tls-key", "PEM private key of --tls-cert")
    tls_client_ca: str | None = option(
        None, "--tls-client-ca", "PEM CA: clients (Envoy) must present a certificate it signed (mTLS)")
    lease_secret: str = option(
        "", "--lease-secret", "key of the lease tickets that let the access-log release path act "
        "only on leases this fleet issued; the same on every replica (a random per-process key "
        "when unset: right for one replica)")
    health_listen: str | None = option(
        None, "--health-listen", "a plaintext port serving only gRPC health, e.g. 0.0.0.0:9003, "
        "for probes that speak no TLS (the kubelet's) when the gRPC port uses TLS; 'off' (or '') "
        "turns it off", shown="off")
    fluentd_listen: str | None = option(
        None, "--fluentd-listen", "the fluentd release port: Envoy's fluentd access logger gives "
        "leases back here (envoy-config --access-log fluentd), e.g. 127.0.0.1:9004; as trusted as "
        "the gRPC access log, so localhost or the pod only (docs/security.md); 'off' (or '') turns "
        "it off", shown="off")
    record_dir: str | None = option(
        None, "--record", "record one JSON line per finished request (hashed identity, tier, "
        "decision, duration) into rotating gzip files in DIR, for `extauthz simulate`",
        metavar="DIR", shown="off")
    record_max_bytes: int = option(
        1 << 30, "--record-max-bytes", "bound on all recording files together; the oldest go "
        "first (e.g. 500M, 2G)", parse=size, shown="1G")
    record_sample: float = option(
        1.0, "--record-sample", "fraction of identities recorded, every request of each (0-1]",
        parse=_fraction, shown="1")
    record_paths: str = option(
        "redacted", "--record-paths", "recorded paths: 'redacted' drops path parameters (;...) "
        "and writes id-like segments (numbers, tokens, sk_live_... keys) as {id}; 'raw' keeps "
        "them verbatim (docs/tuning.md)", choices=("redacted", "raw"))
    workers: int = option(
        1, "--workers", "server processes sharing the --listen port (SO_REUSEPORT); above 1 needs "
        "--redis-url and an Envoy with as many worker threads", parse=_count)
    worker_ports: bool = option(
        False, "--worker-ports", "with --workers N: worker i listens on the --listen port + i (N "
        "ports, listed as N endpoints of Envoy's extauthz cluster) instead of all sharing one "
        "port", kind="switch")
    log_level: str = option("info", "--log-level", "log level")
    log_format: str = option(
        "json", "--log-format", "log lines: one JSON object each, or text", choices=("json", "text"))

    def __post_init__(self) -> None:
        """Every option's range (its parser's: positive, finite, the check budget's bounds)
        and the checks one option's type cannot make, here so that an in-process
        ``Settings(...)`` and a worker's hand-over are held to them as serve's command line
        is. Raises ValueError naming the flag."""
        for name, opt in options().items():
            value = getattr(self, name)
            if opt.parse is not None and value is not None:
                try:
                    opt.parse(str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ValueError(f"{opt.flag}: {exc}") from None
        if not 0.0 < self.record_sample <= 1.0:
            raise ValueError(f"--record-sample must be in (0, 1], not {self.record_sample}")
        try:
            path_prefix(self.http_path_prefix)
        except ValueError as exc:
            raise ValueError(f"--http-path-prefix: {exc}") from None
        if self.workers < 1:  # the rest of --workers' rules need the ports: server/workers.py
            raise ValueError("--workers must be at least 1")


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``; no host: every address) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def path_prefix(value: str) -> str:
    """``--http-path-prefix``: ``""`` (none) or ``/seg[/seg...]`` without a trailing slash."""
    prefix = value.rstrip("/")
    if prefix and (not prefix.startswith("/") or any(c in prefix for c in "?#") or " " in prefix):
        raise ValueError(f"an HTTP path prefix is a path such as /auth, not {value!r}")
    return prefix


def options() -> dict[str, Option]:
    """Field name -> :class:`Option`, in declaration order (the fields with a flag)."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(Settings) if "option" in f.metadata}


def default_text(name: str) -> str | None:
    """A field's default as --help and the docs state it (None: no default to state)."""
    opt = options()[name]
    if opt.shown is not None:
        return opt.shown
    default = getattr(Settings(), name)
    if default in (None, "", (), False):
        return None
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return ",".join(default) if isinstance(default, list) else str(default)


def event_loop() -> str:
    """``EXTAUTHZ_EVENT_LOOP``, not a serve option: serve's event loop, ``uvloop`` (the
    default) or ``asyncio`` (server/app.py; measured in docs/benchmarks.md)."""
    return os.environ.get("EXTAUTHZ_EVENT_LOOP", "uvloop")


def admin_url() -> str | None:
    """``EXTAUTHZ_ADMIN_URL``, not a serve option: the operator commands' admin URL
    (opscli.py), without a trailing slash; None when unset or empty."""
    value = os.environ.get("EXTAUTHZ_ADMIN_URL")
    return value.rstrip("/") if value else None


#: ``serve --workers``' hand-over to each worker process (server/workers.py), not an option: the
#: worker's whole configuration, one :class:`Settings` as JSON (log level and format included),
#: and the pipe on which the worker says it is serving.
WORKER_CONFIG_ENV = "EXTAUTHZ_WORKER_CONFIG"
WORKER_READY_FD_ENV = "EXTAUTHZ_WORKER_READY_FD"


def worker_env(settings: Settings, ready_fd: int) -> dict[str, str]:
    """The variables that hand ``settings`` and the ready pipe ``ready_fd`` to a worker."""
    return {WORKER_CONFIG_ENV: json.dumps(dataclasses.asdict(settings)), WORKER_READY_FD_ENV: str(ready_fd)}


def worker_handover(environ: Mapping[str, str] | None = None) -> tuple[Settings, int]:
    """What :func:`worker_env` handed over: the worker's :class:`Settings` (checked again as
    it is built) and its ready pipe. Raises ValueError when either is missing or malformed."""
    env = os.environ if environ is None else environ
    try:
        tuples = {name for name, value in dataclasses.asdict(Settings()).items() if isinstance(value, tuple)}
        data: dict[str, Any] = {k: tuple(v) if k in tuples else v
                                for k, v in json.loads(env[WORKER_CONFIG_ENV]).items()}
        return (Settings(**data),
                int(env[WORKER_READY_FD_ENV]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not started as a worker of extauthz serve --workers "
                         f"({WORKER_CONFIG_ENV}, {WORKER_READY_FD_ENV}): {exc!r}") from None


def env_value(opt: Option, environ: Mapping[str, str] | None = None) -> str | None:
    """The option's ``EXTAUTHZ_*`` variable, or None when it is not set."""
    return (os.environ if environ is None else environ).get(opt.env)


def _help(name: str, opt: Option) -> str:
    shown = default_text(name)
    extra = ", comma-separated" if opt.kind == "list" else ""
    return f"{opt.help} [{opt.env}{extra}" + (f"; default {shown}]" if shown else "]")


def _argparse_default(name: str, opt: Option) -> Any:
    """The variable's text (argparse parses a string default with ``type``), else the field's."""
    env = env_value(opt)
    if opt.kind == "list":
        return env.split(",") if env else getattr(Settings(), name)
    if env is not None:
        return env
    return None if opt.unset_is_none else getattr(Settings(), name)


def add_arguments(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """Add the options (all, or ``names``) to ``parser``, each with its variable and default."""
    settings = options()
    for name in names if names is not None else list(settings):
        opt = settings[name]
        kw: dict[str, Any] = {"dest": name, "help": _help(name, opt).replace("%", "%%")}
        if opt.kind == "switch":
            parser.add_argument(opt.flag, action="store_true", default=_flag(env_value(opt) or ""), **kw)
            continue
        given = {"nargs": "+" if opt.kind == "list" else None, "type": opt.parse,
                 "choices": opt.choices, "metavar": opt.metavar}
        kw.update({k: v for k, v in given.items() if v is not None})
        parser.add_argument(opt.flag, default=_argparse_default(name, opt), **kw)


def parse_hosts(text: str | None) -> tuple[str, ...]:
    """``--admin-hosts``: comma-separated host names (no port), lower-cased (the admin
    port's Host allow-list, server/adminauth.py)."""
    hosts = tuple(h.strip().lower().strip("[]") for h in (text or "").split(",") if h.strip())
    for h in hosts:
        if not re.fullmatch(r"[a-z0-9_.:-]{1,253}", h):
            raise ValueError(f"--admin-hosts: {h!r} is not a host name or address")
    return hosts


def from_args(args: argparse.Namespace) -> Settings:
    """The one :class:`Settings` of a parsed ``serve`` command line. Raises ValueError for a
    value only the whole configuration can judge (a malformed --admin-hosts)."""
    values = {name: getattr(args, name) for name in options() if hasattr(args, name)}
    values["policies"] = list(values.get("policies") or ())
    admin_listen = values.pop("admin_listen", None)
    url_file = values.pop("admin_url_file", None)
    if url_file is None:  # not given: the file named after the --listen port
        from .portfile import admin_url_path

        try:
            url_file = str(admin_url_path(values.get("listen") or Settings.listen))
        except ValueError:
            url_file = None
    for name in ("http_listen", "redis_url", "admin_token_file", "tls_cert", "tls_key",
                 "tls_client_ca", "health_listen", "fluentd_listen", "record_dir"):
        values[name] = values.get(name) or None  # an empty variable is unset
    values["admin_hosts"] = parse_hosts(values.get("admin_hosts") or None)
    values["lease_secret"] = values.get("lease_secret") or ""
    return Settings(
        **values,
        admin_listen=admin_listen if admin_listen is not None else Settings.admin_listen,
        admin_listen_optional=admin_listen is None,
        admin_url_file=off(url_file))


# -- what the operator commands share with serve -------------------------------------------


def add_shared(parser: argparse.ArgumentParser, names: tuple[str, ...], helps: Mapping[str, str]) -> None:
    """Add serve's options ``names`` to an operator command, with that command's help text,
    the same flag, variable and default as serve."""
    settings = options()
    for name in names:
        opt = settings[name]
        shown = default_text(name)
        env = env_value(opt)
        kw: dict[str, Any] = {"type": opt.parse} if opt.parse is not None else {}
        parser.add_argument(
            opt.flag, dest=name, default=env if env else getattr(Settings(), name),
            help=(f"{helps[name]} [{opt.env}" + (f"; default {shown}]" if shown else "]")).replace("%", "%%"),
            **kw)
