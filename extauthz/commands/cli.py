"""The ``extauthz`` command: serve, check-policies, schema, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import __version__
from ..core import settings
from ..core.settings import K8S_TARGETS, PROTOCOLS
from .opscli import add_parsers as add_ops_parsers
from .opscli import (
    cmd_hash,
    cmd_history,
    cmd_inspect,
    cmd_override,
    cmd_report,
    cmd_status,
    cmd_switch,
    join_dash_values,
)
from .simulate.cli import add_parser as add_simulate_parser
from .simulate.cli import cmd_simulate

if TYPE_CHECKING:
    from ..envoy.blocks import TlsFiles
    from ..policy.model import Policy


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the ext_authz gRPC server (and, with --http-listen, "
                       "the HTTP authorization port)",
                       description="Run the Envoy ext_authz gRPC server (and, with --http-listen, "
                       "the HTTP authorization port). Every option also reads an EXTAUTHZ_* "
                       "environment variable (shown in brackets).")
    settings.add_arguments(p)  # every option, as extauthz/core/settings.py declares it


def cmd_serve(args: argparse.Namespace) -> int:
    from ..core.errors import PolicyError
    from ..observe.logs import configure_logging
    from ..server.adminauth import TokenFile, require_token_when_exposed
    from ..server.app import serve

    try:  # before any process starts: the options (Settings checks itself), the admin port's lock
        config = settings.from_args(args)
        require_token_when_exposed(settings.off(config.admin_listen), config.admin_token_file)
        if config.admin_token_file:
            TokenFile(config.admin_token_file)
    except ValueError as exc:  # a value out of range, AdminConfigError, a malformed --admin-listen
        print(f"extauthz serve: {exc}", file=sys.stderr)
        return 2
    listener = configure_logging(config.log_level, config.log_format)
    try:
        if config.workers != 1:
            from ..server.workers import WorkersError, serve_workers

            try:
                return serve_workers(config)
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
    from ..core.errors import PolicyError
    from ..envoy.rlqs import envoy_limiters, envoy_shedders
    from ..policy import load_policy

    failed = False
    for path in args.paths:
        try:
            policy = load_policy([path])
        except PolicyError as exc:
            failed = True
            for issue in exc.issues:
                print(f"error: {issue}", file=sys.stderr)
        else:
            in_envoy = {s.name: " in envoy" for s in envoy_limiters(policy)}  # docs/rlqs.md
            in_envoy.update({s.name: ", DENY_ALL in envoy" for s in envoy_shedders(policy)})
            names = ", ".join(f"{s.name} ({s.type}, {s.mode}{in_envoy.get(s.name, '')})"
                              for s in policy.limiters) or "no limiters"
            print(f"ok: {path} (version {policy.version}): {names}")
    return 1 if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ..policy.jsonschema import policy_json_schema

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
    from ..core.errors import PolicyError
    from ..policy import load_policy

    try:
        return load_policy(paths)
    except PolicyError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return None


def cmd_envoy_allowed_headers(args: argparse.Namespace) -> int:
    from ..envoy.headers import allowed_headers

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


def cmd_import(args: argparse.Namespace) -> int:
    """``extauthz import ratelimit-config``: converted, checked by the one validator, written."""
    import tempfile
    from pathlib import Path

    from .ratelimit_config import ConvertError, convert_paths

    try:
        converted = convert_paths(args.files)
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    names: list[str] = []
    for conv in converted:
        stem, n = Path(conv.source).stem, 2
        name = f"{stem}.yaml"
        while name in names:
            name, n = f"{stem}-{n}.yaml", n + 1
        names.append(name)
    with tempfile.TemporaryDirectory() as tmp:
        for conv, name in zip(converted, names, strict=True):
            (Path(tmp) / name).write_text(conv.text())
        if _policy_or_errors([tmp]) is None:
            return 1
    for conv in converted:
        for warning in conv.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    if args.output is None:
        sys.stdout.write("\n---\n".join(conv.text() for conv in converted))
        return 0
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for conv, name in zip(converted, names, strict=True):
        (out / name).write_text(conv.text())
        print(f"{conv.source} -> {out / name}", file=sys.stderr)
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from ..envoy.config import JwtProvider, TlsFiles, jwks_from_file, render

    policy = _policy_or_errors(list(args.policies))
    if policy is None:
        return 1
    tls_files = (args.tls_client_cert, args.tls_client_key, args.tls_ca)
    try:
        if any(tls_files) and not all(tls_files):
            raise ValueError("--tls-client-cert, --tls-client-key and --tls-ca go together")
        if args.protocol == "ratelimit":
            sys.stdout.write(_ratelimit_config(args, policy, TlsFiles(*tls_files) if all(tls_files) else None))
            return 0
        if args.domain or args.descriptor_header or args.ext_authz:
            raise ValueError("--domain, --descriptor-header and --ext-authz are for --protocol ratelimit")
        if not 0 < args.listen_port < 65536:
            raise ValueError(f"--listen-port: 1-65535, not {args.listen_port}")
        if bool(args.jwt_issuer) != bool(args.jwt_jwks_file) or (args.jwt_audience and not args.jwt_issuer):
            raise ValueError("--jwt-issuer and --jwt-jwks-file go together (--jwt-audience needs them)")
        jwt = (JwtProvider(args.jwt_issuer, tuple(args.jwt_audience or ()), jwks_from_file(args.jwt_jwks_file))
               if args.jwt_issuer else None)
        text = render(
            policy, protocol=args.protocol, upstream=_host_port("--upstream", args.upstream),
            authz=_host_port("--authz", args.authz[0]) if args.authz else None,
            authz_more=tuple(_host_port("--authz", a) for a in (args.authz or [])[1:]),
            access_log_to=_host_port("--access-log-to", args.access_log_to) if args.access_log_to else None,
            listen_port=args.listen_port, access_log=args.access_log,
            tls=TlsFiles(*tls_files) if all(tls_files) else None,
            tracing=_host_port("--tracing", args.tracing) if args.tracing else None,
            quickstart_routes=args.quickstart_routes, jwt=jwt, check_budget_ms=args.check_budget_ms,
            rlqs=args.rlqs)
    except ValueError as exc:
        print(f"extauthz envoy-config: {exc}", file=sys.stderr)
        return 2
    _warn_unreadable(args.protocol, policy)
    sys.stdout.write(text)
    return 0


def _ratelimit_config(args: argparse.Namespace, policy: Policy, tls: TlsFiles | None) -> str:
    """``envoy-config --protocol ratelimit`` (extauthz/envoy/ratelimit.py)."""
    from ..envoy.ratelimit import render as render_ratelimit

    if args.jwt_issuer or args.tracing or args.quickstart_routes or args.access_log != "auto" or args.rlqs:
        raise ValueError("--jwt-*, --tracing, --quickstart-routes, --access-log and --rlqs are for the "
                         "ext_authz protocols (grpc, http)")
    headers: dict[str, str] = {}
    for item in args.descriptor_header or ():
        key, sep, header = item.partition("=")
        if not sep or not key or not header:
            raise ValueError(f"--descriptor-header: KEY=HEADER, not {item!r}")
        headers[key] = header.lower()
    if args.authz and len(args.authz) > 1:
        raise ValueError("several --authz are for --protocol grpc")
    return render_ratelimit(
        policy, upstream=_host_port("--upstream", args.upstream),
        authz=_host_port("--authz", args.authz[0]) if args.authz else None, domain=args.domain, headers=headers,
        listen_port=args.listen_port, tls=tls,
        ext_authz=_host_port("--ext-authz", args.ext_authz) if args.ext_authz else None,
        check_budget_ms=args.check_budget_ms)


def _warn_unreadable(protocol: str, policy: Policy) -> None:
    """On the HTTP protocol, a ``warning:`` line for each part the policy reads that it cannot
    carry (``envoy-config`` and ``k8s`` alike)."""
    if protocol == "http":
        from ..envoy.headers import unreadable_over_http

        for problem in unreadable_over_http(policy):
            print(f"warning: {problem}", file=sys.stderr)


def _pairs(flag: str, values: list[str] | None, form: str) -> tuple[tuple[str, str], ...]:
    """``A=B`` / ``A/B`` options as pairs; ``form`` (``KEY=VALUE``) names the shape."""
    sep = "/" if "/" in form else "="
    out = []
    for value in values or ():
        left, found, right = value.partition(sep)
        if not found or not left or not right:
            raise ValueError(f"{flag}: {form}, not {value!r}")
        out.append((left, right))
    return tuple(out)


def cmd_k8s(args: argparse.Namespace) -> int:
    from .k8s import Wiring, render

    policy = _policy_or_errors(list(args.policies))
    if policy is None:
        return 1
    try:
        wiring = Wiring(
            target=args.target, protocol=args.protocol, service=args.service,
            service_namespace=args.service_namespace, port=args.port, als_port=args.als_port,
            namespace=args.namespace, name=args.name,
            target_refs=_pairs("--target-ref", args.target_ref, "KIND/NAME"),
            selector=_pairs("--selector", args.selector, "KEY=VALUE"),
            context_extensions=_pairs("--context-extension", args.context_extension, "NAME=VALUE"),
            http_path=args.http_path, check_budget_ms=args.check_budget_ms,
            skip_paths=tuple(args.skip_path or ()), fail_closed=args.fail_closed)
    except ValueError as exc:
        print(f"extauthz k8s: {exc}", file=sys.stderr)
        return 2
    from ..envoy.rlqs import envoy_limiters

    if in_envoy := [s.name for s in envoy_limiters(policy)]:
        print(f"extauthz k8s: the policy enforces {', '.join(in_envoy)} in Envoy (enforce: envoy), and these "
              "resources carry no rate limit quota filter: nothing would enforce them (docs/rlqs.md)",
              file=sys.stderr)
        return 2
    _warn_unreadable(args.protocol, policy)
    sys.stdout.write(render(policy, wiring))
    return 0


def _add_k8s(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = ("print the Kubernetes resources that wire the server in: Envoy Gateway SecurityPolicy "
            "(+ EnvoyProxy, ReferenceGrant), or Istio's extensionProviders, CUSTOM AuthorizationPolicy "
            "and Telemetry, with the headers the policy reads (docs/gateways.md)")
    p = sub.add_parser("k8s", help=text, description=text)
    p.add_argument("--target", choices=K8S_TARGETS, required=True,
                   help="Envoy Gateway, an Istio sidecar or ingress gateway (--selector), or an ambient waypoint")
    p.add_argument("--policies", nargs="+", required=True, metavar="DIR", help="policy file(s) or directory")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                   help="the Check call (gRPC port) or Envoy's HTTP authorization protocol (server.httpPort); "
                   "default grpc")
    p.add_argument("--service", default="extauthz", help="the server's Service (default extauthz)")
    p.add_argument("--service-namespace", default="extauthz", metavar="NS",
                   help="its namespace (default extauthz)")
    p.add_argument("--port", type=int, default=None, metavar="N",
                   help="the Service's gRPC (default 9001) or HTTP (default 9003) port")
    p.add_argument("--als-port", type=int, default=9001, metavar="N",
                   help="the gRPC port that receives the access log (default 9001)")
    p.add_argument("--namespace", default="default", metavar="NS",
                   help="where the policies go: the routes' (Envoy Gateway), the workloads' or gateway's "
                   "(Istio), the waypoint's (ambient); default default")
    p.add_argument("--name", default=None,
                   help="the SecurityPolicy's or AuthorizationPolicy's name (default extauthz-PROTOCOL, "
                   "extauthz, extauthz-waypoint)")
    p.add_argument("--target-ref", action="append", metavar="KIND/NAME",
                   help="what the policy attaches to, repeatable: HTTPRoute/NAME or Gateway/NAME (Envoy "
                   "Gateway), Gateway/WAYPOINT or Service/NAME (ambient; default Gateway/waypoint)")
    p.add_argument("--selector", action="append", metavar="KEY=VALUE",
                   help="istio-sidecar: the workloads' labels, repeatable (istio=ingressgateway for the "
                   "ingress gateway)")
    p.add_argument("--context-extension", action="append", metavar="NAME=VALUE",
                   help="Envoy Gateway, gRPC: a context extension for the routes (tier=NAME names a tier; "
                   "others feed limiter key parts {context_extension: NAME}), repeatable")
    p.add_argument("--http-path", default=None, metavar="PATH",
                   help="HTTP protocol: Envoy Gateway extAuth.http.path, Istio envoyExtAuthzHttp.pathPrefix "
                   "(run the server with --http-path-prefix PATH)")
    p.add_argument("--skip-path", action="append", metavar="PATH",
                   help="Istio: a path the AuthorizationPolicy exempts from the check (notPaths), repeatable; "
                   "it applies to every workload the policy covers, the application's own paths of that "
                   "name too (default: none, every request is checked)")
    p.add_argument("--fail-closed", action="store_true",
                   help="refuse requests with 503 when the server cannot answer (failOpen: false, "
                   "statusOnError 503; Envoy Gateway v1.8.0 or later) instead of letting them through "
                   "(default: fail open)")
    settings.add_shared(p, ("check_budget_ms",), {"check_budget_ms": (
        "the server's check budget (serve --check-budget-ms): the authorization timeout is this "
        f"plus {settings.ENVOY_MARGIN_MS:.0f} ms")})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extauthz",
        description="Envoy external authorization server: per-user rate and concurrency "
        "limits, fleet and worker load shedding.",
    )
    parser.add_argument("--version", action="version", version=f"extauthz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    text = ("convert another service's config into policy files: 'ratelimit-config' takes "
            "envoyproxy/ratelimit config files (docs/migrating.md)")
    p = sub.add_parser("import", help=text, description=text)
    what = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    text = ("envoyproxy/ratelimit config files -> policy files with the same decisions; what cannot "
            "be converted is refused with its file and line (exit 1)")
    q = what.add_parser("ratelimit-config", help=text, description=text)
    q.add_argument("files", nargs="+", metavar="FILE", help="a config file, or a directory of them")
    q.add_argument("-o", "--output", metavar="DIR", default=None,
                   help="write one policy file per input into DIR (default: print them)")
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
    p.add_argument("--protocol", choices=(*PROTOCOLS, "ratelimit"), required=True,
                   help="the ext_authz filter's grpc_service (Check) or http_service (serve --http-listen); "
                   "ratelimit: Envoy's global rate limit filter calling ShouldRateLimit on the gRPC port, "
                   "its actions from the policy's limiters with 'match' (docs/migrating.md)")
    p.add_argument("--domain", default=None, help="ratelimit: the domain the filter sends (default: the "
                   "policy's only one)")
    p.add_argument("--descriptor-header", action="append", metavar="KEY=HEADER",
                   help="ratelimit: the request header a descriptor entry's value comes from (default: the "
                   "key with '-' for '_'); repeatable")
    p.add_argument("--ext-authz", metavar="HOST:PORT", default=None,
                   help="ratelimit: an ext_authz filter before it, calling your own auth service there")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the protected application")
    p.add_argument("--authz", metavar="HOST:PORT", default=None, action="append",
                   help="where Envoy reaches the server: its gRPC port (grpc) or HTTP authorization "
                   "port (http); default 127.0.0.1:9001 / 127.0.0.1:9003. Repeat for several replicas "
                   "in one cluster (grpc: the checks, the access log and the quota stream, which moves "
                   "to another replica when its own goes; a host name resolving to several addresses "
                   "does the same)")
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
    p.add_argument("--rlqs", action="store_true",
                   help="the rate limit quota filter for the policy's enforce: envoy limiters, before "
                   "ext_authz: Envoy holds their tokens and streams usage to the server's gRPC port, "
                   "which divides each limit (docs/rlqs.md); needed when the policy has such limiters")
    settings.add_shared(p, ("check_budget_ms",), {"check_budget_ms": (
        "the server's check budget (serve --check-budget-ms): Envoy's ext_authz timeout is this "
        f"plus {settings.ENVOY_MARGIN_MS:.0f} ms, so that the server decides before Envoy fails the check open")})
    _add_k8s(sub)
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


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser ``args`` came through (``override set``)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or name not in sub.choices:
            return parser
        parser = sub.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(join_dash_values(sys.argv[1:] if argv is None else argv))
    if extra:  # said by the (sub)command's parser: `extauthz override set: error: ...`, one form
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    handler = {
        "serve": cmd_serve,
        "check-policies": cmd_check_policies,
        "import": cmd_import,
        "schema": cmd_schema,
        "envoy-allowed-headers": cmd_envoy_allowed_headers,
        "envoy-config": cmd_envoy_config,
        "k8s": cmd_k8s,
        "demo": cmd_demo,
        "switch": cmd_switch,
        "report": cmd_report,
        "status": cmd_status,
        "override": cmd_override,
        "history": cmd_history,
        "hash": cmd_hash,
        "inspect": cmd_inspect,
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
