"""The ``extauthz`` command: serve, check-policies, schema, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import __version__
from .answers import PROTOCOLS
from .errors import PolicyError
from .opscli import add_parsers as add_ops_parsers
from .opscli import cmd_history, cmd_override, cmd_report, cmd_status, cmd_switch
from .simulate.cli import add_parser as add_simulate_parser
from .simulate.cli import cmd_simulate

if TYPE_CHECKING:
    from .policy.model import Policy


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"EXTAUTHZ_{name}", default)


def _env_flag(name: str) -> bool:
    """A boolean ``EXTAUTHZ_*`` variable: 1, true or yes."""
    return (_env(name, "") or "").lower() in ("1", "true", "yes")


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b") or "0"
    try:
        value = float(t[:-1]) * units[t[-1]] if t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes or e.g. 500M, 2G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be positive")
    return int(value)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: must be at least 1")
    return value


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the ext_authz gRPC server (and, with --http-listen, "
                       "the HTTP authorization port)",
                       description="Run the Envoy ext_authz gRPC server (and, with --http-listen, "
                       "the HTTP authorization port). Every option also reads an EXTAUTHZ_* "
                       "environment variable (shown in brackets).")
    p.add_argument("--policies", nargs="+", default=(_env("POLICIES") or "policies").split(","),
                   help="policy file(s) or directory [EXTAUTHZ_POLICIES, comma-separated; default policies/]")
    p.add_argument("--policy-max-bytes", type=_size, default=_size(_env("POLICY_MAX_BYTES", "1M") or "1M"),
                   help="bound on one policy file's size, checked before parsing; a larger file "
                   "fails the start or the reload (the last good policy keeps serving) "
                   "[EXTAUTHZ_POLICY_MAX_BYTES; default 1M, a ConfigMap's limit]")
    p.add_argument("--listen", default=_env("LISTEN", "0.0.0.0:9001"),
                   help="gRPC Check + AccessLog + health port; 'off' (or '') turns it off "
                   "[EXTAUTHZ_LISTEN; default 0.0.0.0:9001]")
    p.add_argument("--http-listen", default=_env("HTTP_LISTEN"),
                   help="HTTP authorization port for Envoy's http_service (and other forward-auth "
                   "proxies), e.g. 0.0.0.0:9003; off unless given (docs/http.md) [EXTAUTHZ_HTTP_LISTEN]")
    p.add_argument("--http-max-active-checks", type=_positive,
                   default=_env("HTTP_MAX_ACTIVE_CHECKS"),
                   help="checks decided at once on the HTTP port; more wait before they start, "
                   "so at saturation the store deadline measures the store, not the queue "
                   "(docs/http.md) [EXTAUTHZ_HTTP_MAX_ACTIVE_CHECKS; default 8]")
    p.add_argument("--http-max-connections", type=_positive,
                   default=_env("HTTP_MAX_CONNECTIONS"),
                   help="open connections on the HTTP port at once; one more is closed unanswered "
                   "(docs/http.md) [EXTAUTHZ_HTTP_MAX_CONNECTIONS; default: the file limit "
                   "(ulimit -n) less a quarter (at least 128) for the other ports, Redis and "
                   "files, at most 4096]")
    p.add_argument("--http-forward-auth", action="store_true",
                   default=_env_flag("HTTP_FORWARD_AUTH"),
                   help="on the HTTP port, take the client's method, path and host from "
                   "X-Forwarded-Method/-Uri/-Host (Traefik ForwardAuth); never with Envoy "
                   "[EXTAUTHZ_HTTP_FORWARD_AUTH]")
    p.add_argument("--http-path-prefix", default=_env("HTTP_PATH_PREFIX", ""),
                   help="on the HTTP port, the path prefix Envoy puts before the client's path "
                   "(http_service.path_prefix; Envoy Gateway's SecurityPolicy extAuth.http.path), "
                   "removed before classifying; paths without it are taken as they are "
                   "[EXTAUTHZ_HTTP_PATH_PREFIX; default none]")
    p.add_argument("--redis-url", default=_env("REDIS_URL"),
                   help="Redis store URL; without it the embedded store serves one replica "
                   "[EXTAUTHZ_REDIS_URL]")
    p.add_argument("--store-deadline-ms", type=float, default=float(_env("STORE_DEADLINE_MS", "5") or 5),
                   help="deadline of each store call before failing open [EXTAUTHZ_STORE_DEADLINE_MS; default 5]")
    p.add_argument("--key-prefix", default=_env("KEY_PREFIX", "extauthz"),
                   help="prefix of every store key [EXTAUTHZ_KEY_PREFIX; default extauthz]")
    p.add_argument("--identity-salt", default=_env("IDENTITY_SALT", ""),
                   help="key for hashing identities; same on every replica [EXTAUTHZ_IDENTITY_SALT]")
    p.add_argument("--admin-listen", default=_env("ADMIN_LISTEN"),
                   help="admin HTTP port (status, switches); keep it private; 'off' disables. "
                   "Not given: 127.0.0.1:9002, or an OS-chosen port with a warning when that is "
                   "taken (a second server on the host); given and taken: the start fails "
                   "[EXTAUTHZ_ADMIN_LISTEN; default 127.0.0.1:9002]")
    p.add_argument("--admin-url-file", default=_env("ADMIN_URL_FILE"),
                   help="file the server writes its admin URL to, so that `extauthz switch|report "
                   "--listen HOST:PORT` reach it [EXTAUTHZ_ADMIN_URL_FILE; default "
                   "$XDG_RUNTIME_DIR/extauthz/admin-PORT.url or /tmp/extauthz-UID/admin-PORT.url, "
                   "PORT the --listen port; 'off' disables]")
    p.add_argument("--admin-token-file", default=_env("ADMIN_TOKEN_FILE"),
                   help="file holding the admin port's bearer token (or NAME:TOKEN lines, one per "
                   "operator); every admin request but /healthz then needs Authorization: Bearer "
                   "TOKEN and a change needs a reason. Read again when the file changes. Required "
                   "when --admin-listen is not loopback [EXTAUTHZ_ADMIN_TOKEN_FILE]")
    p.add_argument("--admin-hosts", default=_env("ADMIN_HOSTS"),
                   help="Host header values the admin port answers besides loopback and its own "
                   "--admin-listen address, comma-separated (e.g. a name you reach it by) "
                   "[EXTAUTHZ_ADMIN_HOSTS]")
    p.add_argument("--metrics-listen", default=_env("METRICS_LISTEN"),
                   help="Prometheus metrics port, e.g. 0.0.0.0:9464 [EXTAUTHZ_METRICS_LISTEN]")
    p.add_argument("--lease-secret", default=_env("LEASE_SECRET", ""),
                   help="key of the lease tickets that let the access-log release path act only on "
                   "leases this fleet issued; the same on every replica (a random per-process key "
                   "when unset: right for one replica) [EXTAUTHZ_LEASE_SECRET]")
    p.add_argument("--tls-cert", default=_env("TLS_CERT"),
                   help="PEM certificate (chain) of the gRPC port: TLS on; needs --tls-key. Rotated "
                   "files are picked up without a restart [EXTAUTHZ_TLS_CERT; default: plaintext]")
    p.add_argument("--tls-key", default=_env("TLS_KEY"),
                   help="PEM private key of --tls-cert [EXTAUTHZ_TLS_KEY]")
    p.add_argument("--tls-client-ca", default=_env("TLS_CLIENT_CA"),
                   help="PEM CA: clients (Envoy) must present a certificate it signed (mTLS) "
                   "[EXTAUTHZ_TLS_CLIENT_CA]")
    p.add_argument("--health-listen", default=_env("HEALTH_LISTEN"),
                   help="a plaintext port serving only gRPC health, e.g. 0.0.0.0:9003, for probes "
                   "that speak no TLS (the kubelet's) when the gRPC port uses TLS "
                   "[EXTAUTHZ_HEALTH_LISTEN; default off]")
    p.add_argument("--fluentd-listen", default=_env("FLUENTD_LISTEN"),
                   help="the fluentd release port: Envoy's fluentd access logger gives leases back "
                   "here (envoy-config --access-log fluentd), e.g. 127.0.0.1:9004; as trusted as the "
                   "gRPC access log, so localhost or the pod only (docs/security.md) "
                   "[EXTAUTHZ_FLUENTD_LISTEN; default off]")
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", "1") or 1),
                   help="server processes sharing the --listen port (SO_REUSEPORT); above 1 "
                   "needs --redis-url and an Envoy with as many worker threads [EXTAUTHZ_WORKERS; "
                   "default 1]")
    p.add_argument("--worker-ports", action="store_true",
                   default=_env_flag("WORKER_PORTS"),
                   help="with --workers N: worker i listens on the --listen port + i (N ports, "
                   "listed as N endpoints of Envoy's extauthz cluster) instead of all sharing "
                   "one port [EXTAUTHZ_WORKER_PORTS]")
    p.add_argument("--reuse-port", action="store_true",
                   default=_env_flag("REUSE_PORT"),
                   help="let another process bind the same --listen port (SO_REUSEPORT): a new "
                   "version starts beside this one, then this one gets SIGTERM and drains "
                   "[EXTAUTHZ_REUSE_PORT]")
    p.add_argument("--record", metavar="DIR", default=_env("RECORD"),
                   help="record one JSON line per finished request (hashed identity, tier, decision, "
                   "duration) into rotating gzip files in DIR, for `extauthz simulate` [EXTAUTHZ_RECORD; off]")
    p.add_argument("--record-max-bytes", type=_size, default=_size(_env("RECORD_MAX_BYTES", "1G") or "1G"),
                   help="bound on all recording files together; the oldest go first (e.g. 500M, 2G) "
                   "[EXTAUTHZ_RECORD_MAX_BYTES; default 1G]")
    p.add_argument("--record-sample", type=float, default=float(_env("RECORD_SAMPLE", "1") or 1),
                   help="fraction of identities recorded, every request of each (0-1] "
                   "[EXTAUTHZ_RECORD_SAMPLE; default 1]")
    p.add_argument("--record-paths", choices=("redacted", "raw"), default=_env("RECORD_PATHS", "redacted"),
                   help="recorded paths: 'redacted' drops path parameters (;...) and writes id-like "
                   "segments (numbers, tokens, sk_live_... keys) as {id}; 'raw' keeps them verbatim "
                   "(docs/tuning.md) [EXTAUTHZ_RECORD_PATHS; default redacted]")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"),
                   help="log level [EXTAUTHZ_LOG_LEVEL; default info]")
    p.add_argument("--log-format", choices=("json", "text"), default=_env("LOG_FORMAT", "json"),
                   help="log lines: one JSON object each, or text [EXTAUTHZ_LOG_FORMAT; default json]")


def cmd_serve(args: argparse.Namespace) -> int:
    from .observe.logs import configure_logging
    from .server.adminauth import TokenFile, parse_hosts, require_token_when_exposed
    from .server.app import ServerConfig, serve
    from .server.httpmap import path_prefix
    from .server.portfile import admin_url_path
    from .server.ports import off

    if not 0.0 < args.record_sample <= 1.0:
        print(f"extauthz: --record-sample must be in (0, 1], not {args.record_sample}", file=sys.stderr)
        return 2
    try:
        path_prefix(args.http_path_prefix)
    except ValueError as exc:
        print(f"extauthz: --http-path-prefix: {exc}", file=sys.stderr)
        return 2
    admin_listen = args.admin_listen if args.admin_listen is not None else ServerConfig.admin_listen
    try:  # before any process starts: the admin port's lock (server/adminauth.py)
        admin_hosts = parse_hosts(args.admin_hosts)
        require_token_when_exposed(off(admin_listen), args.admin_token_file or None)
        if args.admin_token_file:
            TokenFile(args.admin_token_file)
    except ValueError as exc:  # AdminConfigError, or a malformed --admin-listen
        print(f"extauthz serve: {exc}", file=sys.stderr)
        return 2
    listener = configure_logging(args.log_level, args.log_format)
    url_file = args.admin_url_file
    if url_file is None:
        try:
            url_file = str(admin_url_path(args.listen))
        except ValueError:
            url_file = None
    config = ServerConfig(
        policies=list(args.policies), policy_max_bytes=args.policy_max_bytes,
        listen=args.listen, http_listen=args.http_listen or None,
        http_forward_auth=args.http_forward_auth,
        http_path_prefix=args.http_path_prefix,
        **({"http_max_active_checks": args.http_max_active_checks} if args.http_max_active_checks else {}),
        http_max_connections=args.http_max_connections,
        redis_url=args.redis_url or None,
        store_deadline_ms=args.store_deadline_ms, key_prefix=args.key_prefix,
        identity_salt=args.identity_salt,
        admin_listen=admin_listen, admin_listen_optional=args.admin_listen is None,
        admin_token_file=args.admin_token_file or None, admin_hosts=admin_hosts,
        admin_url_file=None if (url_file or "off").lower() in ("off", "none") else url_file,
        metrics_listen=args.metrics_listen, reuse_port=args.reuse_port,
        lease_secret=args.lease_secret or "",
        tls_cert=args.tls_cert or None, tls_key=args.tls_key or None,
        tls_client_ca=args.tls_client_ca or None, health_listen=args.health_listen or None,
        fluentd_listen=args.fluentd_listen or None,
        record_dir=args.record or None, record_max_bytes=args.record_max_bytes,
        record_sample=args.record_sample, record_paths=args.record_paths,
    )
    workers = getattr(args, "workers", 1)
    try:
        if workers != 1:
            from .server.workers import WorkersError, serve_workers

            try:
                return serve_workers(config, workers, log_level=args.log_level,
                                     log_format=args.log_format,
                                     own_ports=getattr(args, "worker_ports", False))
            except WorkersError as exc:
                print(f"extauthz: {exc}", file=sys.stderr)
                return 2
        serve(config)
    except PolicyError as exc:
        logging.getLogger("extauthz.server").error("the policy has errors, not starting:\n%s", exc, extra={
            "fields": {"event": "policy_invalid", "issues": [str(i) for i in exc.issues]}})
        return 2
    except (OSError, ValueError) as exc:  # a port taken or malformed, a certificate unreadable, ...
        logging.getLogger("extauthz.server").error("not starting: %s", exc, extra={
            "fields": {"event": "start_failed"}})
        print(f"extauthz serve: {exc}", file=sys.stderr)
        return 2
    finally:
        listener.stop()
    return 0


def cmd_check_policies(args: argparse.Namespace) -> int:
    from .policy import load_policy

    failed = False
    for path in args.paths:
        try:
            policy = load_policy([path])
        except PolicyError as exc:
            failed = True
            for issue in exc.issues:
                print(f"error: {issue}", file=sys.stderr)
        else:
            names = ", ".join(f"{s.name} ({s.type}, {s.mode})" for s in policy.limiters) or "no limiters"
            print(f"ok: {path} (version {policy.version}): {names}")
    return 1 if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from .policy.jsonschema import policy_json_schema

    print(json.dumps(policy_json_schema(), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.pictures:
        from .pictures import main as pictures_main

        return pictures_main(args.pictures, time_scale=args.time_scale)
    from .demo import main as demo_main

    return demo_main(policies=args.policies, protocol=args.protocol)


def _policy_or_errors(paths: list[str]) -> Policy | None:
    """The policy, or None after printing each of its problems."""
    from .policy import load_policy

    try:
        return load_policy(paths)
    except PolicyError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return None


def cmd_envoy_allowed_headers(args: argparse.Namespace) -> int:
    from .server.httpmap import allowed_headers

    policy = _policy_or_errors(list(args.policies))
    if policy is None:
        return 1
    service = "http_service" if args.protocol == "http" else "grpc_service"
    print(f"# ext_authz ({service}): the request headers the policy and the {args.protocol} edge read")
    print("allowed_headers:\n  patterns:")
    for name in allowed_headers(policy.needed_headers, args.protocol):
        print(f"  - {{exact: {name}}}")
    return 0


def _host_port(flag: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: HOST:PORT with a port in 1-65535, not {value!r}")
    return host.strip("[]"), int(port)


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from .envoy_bootstrap import JwtProvider, TlsFiles, jwks_from_file, render

    policy = _policy_or_errors(list(args.policies))
    if policy is None:
        return 1
    tls_files = (args.tls_client_cert, args.tls_client_key, args.tls_ca)
    try:
        if any(tls_files) and not all(tls_files):
            raise ValueError("--tls-client-cert, --tls-client-key and --tls-ca go together")
        if not 0 < args.listen_port < 65536:
            raise ValueError(f"--listen-port: 1-65535, not {args.listen_port}")
        if bool(args.jwt_issuer) != bool(args.jwt_jwks_file) or (args.jwt_audience and not args.jwt_issuer):
            raise ValueError("--jwt-issuer and --jwt-jwks-file go together (--jwt-audience needs them)")
        jwt = (JwtProvider(args.jwt_issuer, tuple(args.jwt_audience or ()), jwks_from_file(args.jwt_jwks_file))
               if args.jwt_issuer else None)
        text = render(
            policy, protocol=args.protocol, upstream=_host_port("--upstream", args.upstream),
            authz=_host_port("--authz", args.authz) if args.authz else None,
            access_log_to=_host_port("--access-log-to", args.access_log_to) if args.access_log_to else None,
            listen_port=args.listen_port, access_log=args.access_log,
            tls=TlsFiles(*tls_files) if all(tls_files) else None,
            tracing=_host_port("--tracing", args.tracing) if args.tracing else None,
            quickstart_routes=args.quickstart_routes, jwt=jwt)
    except ValueError as exc:
        print(f"extauthz envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extauthz",
        description="Envoy external authorization server: per-user rate and concurrency "
        "limits, fleet and worker load shedding.",
    )
    parser.add_argument("--version", action="version", version=f"extauthz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    text = ("validate policy files or directories: errors name file, line and field; "
            "exit 1 on error")
    p = sub.add_parser("check-policies", help=text, description=text)
    p.add_argument("paths", nargs="+", help="a policy file or a directory (one policy per argument)")
    text = "print the policy JSON Schema (also docs/policy.schema.json)"
    sub.add_parser("schema", help=text, description=text)
    text = ("print the ext_authz allowed_headers list Envoy's authorization protocol needs for a "
            "policy (docs/http.md)")
    p = sub.add_parser("envoy-allowed-headers", help=text, description=text)
    p.add_argument("policies", nargs="+", help="policy file(s) or directory")
    p.add_argument("--protocol", choices=PROTOCOLS, default="http",
                   help="the filter's grpc_service (envoy.yaml and its variants) or http_service "
                   "(envoy-http.yaml); default http")
    text = ("print a complete Envoy bootstrap for a policy: ext_authz with the headers it reads, "
            "the filters stripping client copies of trusted headers, the 503 mapping (HTTP), "
            "the access log when the policy holds leases (docs/envoy.md)")
    p = sub.add_parser("envoy-config", help=text, description=text)
    p.add_argument("--policies", nargs="+", required=True, metavar="DIR", help="policy file(s) or directory")
    p.add_argument("--protocol", choices=PROTOCOLS, required=True,
                   help="the ext_authz filter's grpc_service (Check) or http_service (serve --http-listen)")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the protected application")
    p.add_argument("--authz", metavar="HOST:PORT", default=None,
                   help="where Envoy reaches the server: its gRPC port (grpc) or HTTP authorization "
                   "port (http); default 127.0.0.1:9001 / 127.0.0.1:9003")
    p.add_argument("--access-log-to", metavar="HOST:PORT", default=None,
                   help="the gRPC port that receives the access log (default: --authz on grpc, "
                   "port 9001 of the --authz host on http); with --access-log fluentd the server's "
                   "fluentd port (default port 9004 of the --authz host)")
    p.add_argument("--listen-port", type=int, default=10000, metavar="N",
                   help="Envoy's listener port on 127.0.0.1 (default 10000)")
    p.add_argument("--tls-client-cert", default=None, help="Envoy's client certificate (mTLS to the gRPC port)")
    p.add_argument("--tls-client-key", default=None, help="its private key")
    p.add_argument("--tls-ca", default=None, help="the CA that signed the server's certificate")
    p.add_argument("--access-log", choices=("auto", "always", "never", "fluentd"), default="auto",
                   help="the gRPC access log that releases leases: auto = only when the policy "
                   "holds a lease limiter (concurrent_requests, fleet_usage, an inflight signal); "
                   "fluentd = always, through Envoy's fluentd logger to serve --fluentd-listen "
                   "(the cheaper release path; docs/envoy.md)")
    p.add_argument("--tracing", metavar="HOST:PORT", default=None,
                   help="OpenTelemetry tracing (100%% sampled) to this OTLP/gRPC collector (default: none)")
    p.add_argument("--quickstart-routes", action="store_true",
                   help="add the quick start's demo routes: /v1/charges (POST) and /v1/refunds critical, "
                   "/v1/reports get by route, /v1/ext/ post by context extension (gRPC) or route (HTTP)")
    p.add_argument("--jwt-issuer", metavar="ISSUER", default=None,
                   help="verify JWTs from this issuer (jwt_authn before ext_authz; a request without a "
                   "token passes) and hand their payload to the server for identity rules")
    p.add_argument("--jwt-audience", metavar="AUD", action="append", default=None,
                   help="an accepted audience (repeat for several; default: any)")
    p.add_argument("--jwt-jwks-file", metavar="PATH", default=None,
                   help="the issuer's JWKS (JSON), inlined into the config")
    add_ops_parsers(sub)
    add_simulate_parser(sub)
    text = ("quick start: Envoy + server + upstream on this machine, a burst of traffic per "
            "tier, and a summary")
    p = sub.add_parser("demo", help=text, description=text)
    p.add_argument("--policies", nargs="+", default=None, help="policy to demo (default: the packaged demo policy)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                   help="Envoy's authorization protocol: gRPC (envoy/envoy.yaml) or HTTP "
                   "(envoy/envoy-http.yaml, serve --http-listen); default grpc")
    p.add_argument("--pictures", metavar="DIR", default=None,
                   help="instead, run the four scenarios of Stripe's post (request rate, concurrency, "
                   "fleet usage, worker utilization) and write a PNG + summary for each into DIR "
                   "(needs the tune extra: matplotlib)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --pictures: stretch (>1) or shrink (<1) every duration (default 1: about a minute)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "serve": cmd_serve,
        "check-policies": cmd_check_policies,
        "schema": cmd_schema,
        "envoy-allowed-headers": cmd_envoy_allowed_headers,
        "envoy-config": cmd_envoy_config,
        "demo": cmd_demo,
        "switch": cmd_switch,
        "report": cmd_report,
        "status": cmd_status,
        "override": cmd_override,
        "history": cmd_history,
        "simulate": cmd_simulate,
    }[args.command]
    try:
        return handler(args)
    except BrokenPipeError:
        # `extauthz schema | head`: the reader left; end quietly, as cat and grep do
        # (stdout to /dev/null so that the interpreter's final flush cannot fail again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
