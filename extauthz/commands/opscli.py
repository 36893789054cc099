"""``extauthz switch``, ``report``, ``status``, ``override`` and ``history``: the operator's
side of safe rollout.

They talk to a running server's admin port (``--admin URL``; or ``--listen HOST:PORT``, the
server's gRPC port, whose admin URL the server wrote to a file on this host: see
``extauthz.core.portfile``; by default the URL the server on the default ``--listen`` (or
``EXTAUTHZ_LISTEN``) wrote, then ``http://127.0.0.1:9002``) or, with ``--redis-url`` (switch,
report, override, history), straight to the Redis every replica reads (the same key and JSON
the servers use), which also works when no admin port is reachable. Each says on stderr which
admin URL it talked to. With ``--admin-token-file`` (``EXTAUTHZ_ADMIN_TOKEN_FILE``) they send
the token; a change then needs ``--reason``. Every change is recorded with its reason and
who made it (``extauthz.control.changelog``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.settings import RECENT_REFUSALS_PER_IDENTITY, Settings, add_shared, admin_url, env_value, options
from ..core.verdict import Mode

if TYPE_CHECKING:  # imported where used: `extauthz status --help` starts without the policy's models
    from ..control.changelog import Change
    from ..control.control import AdminTarget, Control
    from ..control.overrides import Override
    from ..limiters.base import Limiter

#: the server's default --admin-listen, as a URL
DEFAULT_ADMIN = f"http://{Settings.admin_listen}"
#: the server's default --listen: by default the CLI first tries the admin URL it wrote.
DEFAULT_LISTEN = Settings.listen
#: the identity rule an override is hashed for when neither --source nor --policies says.
DEFAULT_SOURCE = "header:x-api-key"
CLEAR = "clear"


class CliError(Exception):
    """A refused command (with the control interface's and the overrides' errors: one
    handler, :func:`_guarded`)."""
R = TypeVar("R")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin", default=None,
                   help=f"a server's admin URL [EXTAUTHZ_ADMIN_URL; default {DEFAULT_ADMIN}]")
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="reach the server on this host started with this --listen (e.g. the second "
                   "of two servers, whose admin port was chosen by the OS): its admin URL is read "
                   "from the file it wrote, $XDG_RUNTIME_DIR/extauthz/admin-PORT.url or "
                   "/tmp/extauthz-UID/admin-PORT.url")
    _add_redis(p, "talk to the fleet's Redis directly instead of an admin port",
               "with --redis-url: the servers' --key-prefix")
    _add_token(p)


def _add_redis(p: argparse.ArgumentParser, url_help: str, prefix_help: str) -> None:
    """--redis-url and --key-prefix, as serve declares them (extauthz/core/settings.py). The URL's
    variable applies unless --admin or --listen is given (:func:`redis_url`)."""
    opt = options()["redis_url"]
    p.add_argument(opt.flag, dest="redis_url", default=None,
                   help=f"{url_help} [{opt.env}, unless --admin or --listen is given]")
    add_shared(p, ("key_prefix",), {"key_prefix": prefix_help})


def redis_url(args: argparse.Namespace) -> str | None:
    """--redis-url; else, when neither --admin nor --listen is given, serve's variable
    (EXTAUTHZ_REDIS_URL): the operator commands then reach the fleet's Redis as the servers do."""
    if args.redis_url is None and not (args.admin or args.listen):
        return env_value(options()["redis_url"]) or None
    return str(args.redis_url) if args.redis_url else None


def _add_token(p: argparse.ArgumentParser) -> None:
    add_shared(p, ("admin_token_file",), {"admin_token_file": "file holding the admin port's token "
                                          "(a bare token or a NAME:TOKEN line; the first is sent)"})


def _add_change(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", default="",
                   help="why (recorded in the change log; required when the admin port has a token)")
    p.add_argument("--by", default=_os_user(),
                   help="who, as recorded beside the token's name (default: the OS user)")


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid())


def _add_override_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "override", help="set, list or clear one customer's limits (live overrides)",
        description="A live override sets one customer's numbers for one limiter (it wins "
        "over the plan) until its TTL. The raw identity (an API key) is hashed here with the "
        "fleet's identity salt and never stored, sent or shown. With --redis-url (or "
        "EXTAUTHZ_REDIS_URL) the override goes to the fleet's Redis and every replica applies "
        "it within about two seconds; without, to a server's admin port (the embedded store).",
        epilog="examples: extauthz override set user-rate --identity sk_live_abc rate=1000 "
        "burst=5000 --ttl 24h --reason 'launch' | extauthz override list | "
        "extauthz override clear user-rate --identity sk_live_abc")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def common(q: argparse.ArgumentParser, identity: bool) -> None:
        q.add_argument("--admin", default=None,
                       help=f"a server's admin URL (embedded store) [EXTAUTHZ_ADMIN_URL; default {DEFAULT_ADMIN}]")
        q.add_argument("--listen", default=None, metavar="HOST:PORT",
                       help="reach the server on this host started with this --listen (its admin URL file)")
        _add_redis(q, "the fleet's Redis, as for serve", "the servers' --key-prefix")
        _add_token(q)
        q.add_argument("--policies", nargs="+", default=None,
                       help="the fleet's policy: the identity rule (--source) is taken from "
                       "it and checked, an override that would not apply is refused, and "
                       "(with --redis-url) list shows which apply")
        if identity:
            q.add_argument("--identity", required=True,
                           help="the customer's raw identity value (an API key); '-' reads it "
                           "from stdin. Hashed here, never shown")
            add_shared(q, ("identity_salt",), {"identity_salt": "the fleet's --identity-salt"})
            q.add_argument("--source", default=None,
                           help="the identity rule that names this customer, as the policy "
                           "labels it: header:NAME, source_ip, principal or "
                           "metadata:NAMESPACE:PATH (default: with --policies the policy's "
                           f"first identity rule, which is checked; else {DEFAULT_SOURCE}, "
                           "with a warning)")

    q = actions.add_parser("set", help="set (or replace) one customer's numbers for a limiter")
    common(q, True)
    q.add_argument("limiter", help="the limiter's name")
    q.add_argument("numbers", nargs="+", metavar="NAME=VALUE",
                   help="rate=1000 burst=5000 cost=1 (request_rate) or limit=200 (concurrent_requests, quota)")
    q.add_argument("--ttl", default="24h", help="expiry, a duration like 30m, 24h or 7d "
                   "(units ms, s, m, h, d; at most 30 days; default 24h)")
    _add_change(q)
    q = actions.add_parser("list", help="live overrides: limiter, hashed identity, numbers, "
                           "reason, who/when, expiry, applied")
    common(q, False)
    q.add_argument("--json", action="store_true", help="print JSON")
    q = actions.add_parser("clear", help="remove one customer's override for a limiter")
    common(q, True)
    q.add_argument("limiter", help="the limiter's name")
    _add_change(q)


#: options whose value may start with '-' (``--ttl -1h``): argparse would read it as a flag
DASH_VALUE_OPTIONS = ("--ttl",)


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--ttl -1h`` as ``--ttl=-1h``, so that the value reaches its check (a TTL is
    positive) instead of argparse's "expected one argument"."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in DASH_VALUE_OPTIONS:
            value = next(it, None)
            if value is not None and value.startswith("-") and value[1:2].isdigit():
                out.append(f"{arg}={value}")
                continue
            out.append(arg)
            if value is not None:
                out.append(value)
            continue
        out.append(arg)
    return out


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "switch", help="set, clear or list the runtime kill switches",
        description="Kill switches override a limiter's policy mode (or, with '*', cap every "
        "limiter) until cleared: enforce, shadow (evaluate, record, allow) or off. Every "
        "replica applies a change within about a second.",
        epilog="examples: extauthz switch user-rate shadow | extauthz switch '*' off | "
        "extauthz switch user-rate clear | extauthz switch --list")
    _add_target(p)
    p.add_argument("--list", action="store_true", help="show the switches and effective modes")
    p.add_argument("name", nargs="?", help="a limiter name, or '*' for the global switch")
    p.add_argument("mode", nargs="?", choices=[*(m.value for m in Mode), CLEAR],
                   help="enforce | shadow | off | clear")
    p.add_argument("--policies", nargs="+", default=None,
                   help="the fleet's policy: a switch to set must name one of its limiters (refused before "
                   "anything is sent, as the admin port checks against its own; a switch that is set can "
                   "always be cleared), and with --redis-url "
                   "--list shows their modes; with --redis-url and without it the name is checked "
                   "for its form only, with a warning")
    _add_change(p)

    p = sub.add_parser(
        "report", help="dark-launch report: who shadow limiters would have refused",
        description="Per limiter, the identities (hashed) and routes that shadow limiters "
        "would have refused over a time window, with counts and the lowest headroom seen.")
    _add_target(p)
    p.add_argument("--window", default="1h", help="how far back: 15m, 1h, 24h or seconds (default 1h)")
    p.add_argument("--top", type=int, default=10, help="rows per limiter (default 10)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--identities", metavar="FILE", default=None,
                   help="raw keys or names, one a line: each identity they hash to is shown with "
                   "its line, as simulate --identities does (needs --policies for the identity rules)")
    p.add_argument("--policies", nargs="+", default=None, help="the fleet's policy (its identity rules)")
    add_shared(p, ("identity_salt",), {"identity_salt": "the fleet's --identity-salt"})
    _add_override_parser(sub)
    _add_customer_parsers(sub)

    p = sub.add_parser(
        "status", help="print a running server's /status: policy, store, checks allowed and refused, "
        "shedding (--json: all of it)",
        description="GET /status from a server's admin port: --admin URL, or --listen HOST:PORT for "
        "the server on this host started with that --listen. Prints a summary; --json prints the "
        "whole document.")
    p.add_argument("--json", action="store_true", help="print the whole /status document as JSON")
    p.add_argument("--admin", default=None,
                   help=f"a server's admin URL [EXTAUTHZ_ADMIN_URL; default {DEFAULT_ADMIN}]")
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="the server on this host started with this --listen (its admin URL file)")
    _add_token(p)

    p = sub.add_parser(
        "history", help="who changed kill switches and overrides, when and why",
        description="The change log: every change of a kill switch or an override with its "
        "reason, who made it (the admin token's name, the user) and which server took it. "
        "With Redis the whole fleet shares one log (bounded, expiring); with the embedded "
        "store, the server's.")
    _add_target(p)
    p.add_argument("--last", type=int, default=100, help="the last N changes (default 100)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_key(q: argparse.ArgumentParser, required: bool) -> None:
    q.add_argument("key", nargs=None if required else "?", metavar="KEY",
                   help="the customer's raw identity value (an API key); '-' reads it from stdin, "
                   "which keeps it out of process listings and shell history. Hashed here, never "
                   "shown, sent or stored")
    q.add_argument("--policies", nargs="+", default=None,
                   help="the fleet's policy: the identity rule (--source) is taken from it")
    add_shared(q, ("identity_salt",), {"identity_salt": "the fleet's --identity-salt (the hash "
                                       "equals the server's only with the same salt)"})
    q.add_argument("--source", default=None,
                   help="the identity rule that names this customer, as the policy labels it: "
                   "header:NAME, source_ip, principal or metadata:NAMESPACE:PATH (default: with "
                   f"--policies the policy's first identity rule; else {DEFAULT_SOURCE})")


def _add_customer_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "hash", help="print the identity hash of a key, as every other command and log shows it",
        description="The hashed identity the server logs, records and keys its counters by "
        "(extauthz.policy.classify.hash_identity: the identity rule's label and the value, keyed "
        "with --identity-salt). Pass '-' to read the key from stdin.",
        epilog="example: printf %s \"$KEY\" | extauthz hash - --policies policies/ --identity-salt \"$SALT\"")
    _add_key(p, True)

    p = sub.add_parser(
        "inspect", help="one customer's limiters, numbers, live counters and recent refusals",
        description="For one customer (KEY, hashed here, or --identity-hash): every limiter, its "
        "mode, its numbers (plan, live override), the live counters read from the store without "
        "changing them (tokens left and seconds to full, requests in flight, quota used and "
        "reset), the grants the server's replica holds and the refusals it made recently "
        f"(this replica only, the last {RECENT_REFUSALS_PER_IDENTITY} per identity). Through a server's "
        "admin port "
        "(GET /customers/HASH), or with --redis-url (and --policies) from the fleet's Redis "
        "directly (no refusals then: each server keeps its own).",
        epilog="examples: extauthz inspect - --policies policies/ < key.txt | "
        "extauthz inspect --identity-hash 1f0c...e2 --redis-url redis://127.0.0.1:6379 --policies policies/")
    _add_key(p, False)
    p.add_argument("--identity-hash", default=None, metavar="HASH",
                   help="the hashed identity (from a log, report or `extauthz hash`) instead of KEY")
    p.add_argument("--plan", default=None,
                   help="the customer's plan (it comes with each request): numbers and bucket for "
                   "this plan (default: the policy's default plan)")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print JSON")


# -- transports: the control interface (extauthz.control.control) ----------------------------------


def admin_base(args: argparse.Namespace) -> list[str]:
    """--admin; else the URL the server on --listen wrote; else EXTAUTHZ_ADMIN_URL; else the
    URL the server on the default --listen (EXTAUTHZ_LISTEN, or 0.0.0.0:9001) wrote, then
    the default URL. A server started beside an old one during its drain gets an OS-chosen
    admin port and rewrites that file, so the defaults find it after the old one exits."""
    from ..core.portfile import read_admin_url

    if args.admin:
        return [str(args.admin).rstrip("/")]
    if args.listen:
        try:
            return [read_admin_url(args.listen).rstrip("/")]
        except (OSError, ValueError) as exc:
            raise CliError(str(exc)) from None
    env_url = admin_url()
    if env_url:
        return [env_url]
    bases: list[str] = []
    try:
        bases.append(read_admin_url(env_value(options()["listen"]) or DEFAULT_LISTEN).rstrip("/"))
    except (OSError, ValueError):
        pass
    return [*bases, *([DEFAULT_ADMIN] if DEFAULT_ADMIN not in bases else [])]


def admin_target(args: argparse.Namespace, *, change: bool = False) -> AdminTarget:
    """The admin port of ``args``, with the token and (``change``) the reason it sends."""
    from ..control.admintokens import AdminConfigError, client_token
    from ..control.control import AdminTarget

    try:
        token = client_token(args.admin_token_file) if getattr(args, "admin_token_file", None) else None
    except AdminConfigError as exc:
        raise CliError(str(exc)) from None
    reason = str(getattr(args, "reason", "") or "").strip()
    if change and token is not None and not reason:
        raise CliError("--reason is required for a change when the admin port has a token "
                       "(--admin-token-file): it is recorded with the change")
    user = str(getattr(args, "by", "") or _os_user())
    _plain_text(reason, user)
    return AdminTarget(admin_base(args), token=token, reason=reason, user=user)


def _plain_text(reason: str, user: str) -> None:
    """--reason and --by as the admin port and the store take them: no control character."""
    from ..control.changelog import text_problem

    problem = text_problem(reason, "--reason") or text_problem(user, "--by")
    if problem is not None:
        raise CliError(problem)

def error_line(command: str, message: object) -> str:
    """The one form of every operator command's error, argparse's own: ``extauthz
    COMMAND: error: MESSAGE`` (``COMMAND`` as argparse names it: ``override set``)."""
    return f"extauthz {command}: error: {message}"


def warning_line(command: str, message: object) -> str:
    return f"extauthz {command}: warning: {message}"


def _guarded(command: str, body: Callable[[], int]) -> int:
    """Run a command: the one place where a failure becomes a message on stderr (no
    traceback) and exit status 1."""
    from ..control.control import ControlError

    try:
        return body()
    except Exception as exc:
        # a refusal says why; the store's and the policy's errors say what failed too. (An
        # OverrideError can come only from extauthz.control.overrides, once a command imported it.)
        overrides = sys.modules.get(f"{__package__}.overrides")
        said = (CliError, ControlError, *((overrides.OverrideError,) if overrides is not None else ()))
        print(error_line(command, exc if isinstance(exc, said) else f"{type(exc).__name__}: {exc}"),
              file=sys.stderr)
    return 1


def _with_control(args: argparse.Namespace, go: Callable[[Control], Coroutine[Any, Any, R]], *,
                  change: bool = False, limiters: Sequence[Limiter] | None = None,
                  labels: Sequence[str] | None = None, policy: Any = None) -> R:
    """Run ``go`` on the control ``args`` name: the fleet's Redis (``--redis-url``), else a
    server's admin port (``change``: with the reason a token requires)."""
    import asyncio

    from ..control.control import AdminControl, StoreControl

    url = redis_url(args) if hasattr(args, "redis_url") else None  # EXTAUTHZ_REDIS_URL unless --admin/--listen
    if not url:
        control = AdminControl(admin_target(args, change=change))
        return asyncio.run(go(control))

    user, reason = str(getattr(args, "by", "") or ""), str(getattr(args, "reason", "") or "")
    _plain_text(reason, user)

    async def on_redis() -> R:
        from ..store.keys import Keys
        from ..store.redis import RedisStore

        store = RedisStore.from_url(url, deadline=0.2)
        try:
            control = StoreControl(store, Keys(args.key_prefix), limiters=limiters, labels=labels,
                                   user=user, reason=reason, policy=policy)
            result = await go(control)
        finally:
            await store.close()
        if control.changes.failed is not None:  # the change landed: said, exit 0
            parts = (getattr(args, "command", ""), getattr(args, "action", None))
            command = " ".join(str(part) for part in parts if part)
            print(warning_line(command, "the change landed, but the store's change log did not take its "
                               f"record ({control.changes.failed})"), file=sys.stderr)
        return result

    return asyncio.run(on_redis())


# -- switch -------------------------------------------------------------------------------


def _print_switches(data: dict[str, Any]) -> None:
    switches = data.get("switches", {})
    print(f"switches: {json.dumps(switches, sort_keys=True) if switches else 'none'}")
    limiters = data.get("limiters")
    if limiters:
        print(f"{'limiter':<24} {'type':<20} {'policy':<8} {'switch':<8} effective")
        for name, info in limiters.items():
            print(f"{name:<24} {info['type']:<20} {info['policy_mode']:<8} "
                  f"{switches.get(name, '-'):<8} {info['mode']}")


def cmd_switch(args: argparse.Namespace) -> int:
    return _guarded("switch", lambda: _switch(args))


def _switch(args: argparse.Namespace) -> int:
    from ..control.control import check_switch
    from ..control.switches import GLOBAL

    if args.list:
        if args.name or args.mode:
            raise CliError("--list takes no name or mode")
    elif not args.name or not args.mode:
        raise CliError("usage: extauthz switch NAME|'*' enforce|shadow|off|clear (or --list)")
    else:
        check_switch(args.name, None)  # its form, before anything is loaded or sent
    mode = None if args.mode in (None, CLEAR) else Mode(args.mode)
    policy = _load_policy(args.policies)
    limiters = None
    if policy is not None:
        from ..limiters import build_limiters
        from ..store.keys import Keys

        limiters = build_limiters(policy, Keys(args.key_prefix))
        # a switch to set is refused here, before anything is sent (the control's own rule); a
        # clear is checked by the control, against the switches that are set
        if mode is not None:
            check_switch(args.name, limiters)
    elif not args.list and args.name != GLOBAL and redis_url(args):
        print(warning_line("switch", f"no --policies: the name {args.name!r} is checked for its form "
                           "only, not against the fleet's policy (a switch for a limiter the policy "
                           "does not have changes nothing); pass --policies to check it"), file=sys.stderr)

    async def go(control: Control) -> tuple[dict[str, Any], str]:
        data = await (control.switches() if args.list else control.set_switch(args.name, mode))
        return data, control.where

    data, where = _with_control(args, go, change=not args.list, limiters=limiters,
                                labels=policy.identity_labels if policy is not None else None, policy=policy)
    if not args.list:
        what = f"cleared {args.name}" if mode is None else f"{args.name} -> {mode.value}"
        print(f"ok: {what} on {where} (every replica sharing the store applies it within about a second)")
    _print_switches(data)
    return 0


# -- history ------------------------------------------------------------------------------


def cmd_history(args: argparse.Namespace) -> int:
    return _guarded("history", lambda: _history(args))


def _history(args: argparse.Namespace) -> int:
    from ..control.changelog import format_history, with_expiries

    if args.last < 1:
        raise CliError("--last must be at least 1")

    async def go(control: Control) -> list[Change]:
        return await control.history()

    changes = with_expiries(_with_control(args, go), time.time())[-args.last:]  # lapsed overrides too
    if args.json:
        print(json.dumps({"changes": [c.to_dict() for c in changes]}, indent=2))
    else:
        print(format_history(changes))
    return 0


# -- report -------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    return _guarded("report", lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    from ..observe.shadow import format_report
    from ..server.admin import parse_top, parse_window  # the admin port's own rules

    try:
        window = parse_window(args.window)
    except ValueError as exc:
        raise CliError(f"--window: {exc}") from None
    try:
        top = parse_top(str(args.top))
    except ValueError as exc:
        raise CliError(f"--top: {exc}") from None

    async def go(control: Control) -> dict[str, Any]:
        return await control.shadow_report(window, top)

    labels: dict[str, str] = {}
    if args.identities:
        from .simulate.identities import IdentityFile

        policy = _load_policy(args.policies)
        if policy is None:
            raise CliError("--identities needs --policies: the policy's identity rules say how keys are hashed")
        try:
            labels = IdentityFile.read(args.identities, policy, args.identity_salt.encode()).labels
        except ValueError as exc:
            raise CliError(str(exc)) from None
    data = _with_control(args, go)
    for lim in data.get("limiters") or []:
        for row in lim.get("top_identities", []):
            if row.get("identity") in labels:
                row["label"] = labels[row["identity"]]
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0


# -- status -------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    return _guarded("status", lambda: _status(args))


def _status(args: argparse.Namespace) -> int:
    async def go(control: Control) -> dict[str, Any]:
        return await control.status()

    data = _with_control(args, go)
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return 0


def _shed_state(level: float) -> str:
    """What a worker shedder's level means (extauthz.limiters.worker: thirds of the positive part)."""
    if level <= 0:
        return ("not shedding (the level rises above 0 after sustained overload; below 0 it is "
                "still waiting out delay_before_shedding)")
    return "shedding test traffic" + (", then get" if level > 1 / 3 else "") + (
        ", then post" if level > 2 / 3 else "") + "; critical never"


def format_status(data: dict[str, Any]) -> str:
    """``extauthz status`` for people: the figures an operator looks at first."""
    policy = data.get("policy", {})
    store = data.get("store", {})
    lines = [f"extauthz {data.get('extauthz', '?')}: policy version {policy.get('version', '?')} "
             f"from {', '.join(policy.get('sources', [])) or '?'}",
             f"store: {store.get('name', '?')} (breaker {store.get('breaker', '?')})"]
    checks = data.get("checks")
    if isinstance(checks, dict):
        refused = checks.get("rate_limited", 0) + checks.get("shed", 0) + checks.get("failed_closed", 0)
        lines.append(f"checks since start: {checks.get('allowed', 0):,} allowed, {refused:,} denied "
                     f"({checks.get('rate_limited', 0):,} rate limited, {checks.get('shed', 0):,} shed, "
                     f"{checks.get('failed_closed', 0):,} failed closed)")
        for tier, row in checks.get("by_tier", {}).items():
            if any(row.values()):
                denied = sum(n for result, n in row.items() if result != "allowed")
                lines.append(f"  {tier:<9} {row.get('allowed', 0):>10,} allowed {denied:>10,} denied")
    else:
        lines.append("checks since start: not counted (the server runs without a metrics port)")
    fail_open = data.get("fail_open") or {}
    if any(fail_open.values()):
        lines.append("failed open: " + ", ".join(f"{k} {v:,}" for k, v in fail_open.items() if v))
    for shed in data.get("shedding", []):
        level = float(shed.get("level", 0.0))
        util = shed.get("utilization")
        drops = ", ".join(f"{tier} {p:.0%}" for tier, p in shed.get("probabilities", {}).items())
        lines.append(f"shedder {shed['limiter']}: utilization "
                     f"{'-' if util is None else f'{util:.0%}'}, shed level {level:.2f} of 1: "
                     f"{_shed_state(level)}; dropping {drops}")
    switches = data.get("switches") or {}
    lines.append("switches: " + (", ".join(f"{k}={v}" for k, v in sorted(switches.items())) or "none"))
    overrides = data.get("overrides") or {}
    lines.append(f"overrides: {overrides.get('live', 0)} live"
                 + (f", {len(overrides['not_applied'])} not applied" if overrides.get("not_applied") else ""))
    recorder = data.get("recorder")
    if isinstance(recorder, dict):
        lines.append(f"recorder: {recorder.get('recorded', 0):,} lines recorded into {recorder.get('directory')}, "
                     f"{recorder.get('lines_dropped', 0):,} dropped, {recorder.get('write_errors', 0):,} write errors")
    reload = data.get("reload") or {}
    if reload.get("last_error"):
        lines.append(f"policy reload failing: {reload['last_error']}")
    token_file = (data.get("admin") or {}).get("token_file") or {}
    if token_file.get("ok") is False:
        lines.append(f"admin token file NOT read again since {_fmt_time(float(token_file.get('since') or 0))}: "
                     f"{token_file.get('error')}")  # the error says what is kept or revoked
    lines.append("(extauthz status --json: the whole document)")
    from ..control.changelog import printable

    return "\n".join(printable(line) for line in lines)


# -- override -----------------------------------------------------------------------------


def _source(args: argparse.Namespace, policy: Any, command: str | None = None) -> str:
    """The identity rule label the override is hashed for (the hash covers it): --source
    (checked against the policy when given), else the policy's first identity rule, else
    DEFAULT_SOURCE with a warning (a policy naming customers otherwise never matches it)."""
    from ..control.overrides import source_problem

    command = command or f"override {args.action}"
    override = command.startswith("override")
    outcome = "this override never matches" if override else "this hash is not the one the server computes"
    never = "the override would never match" if override else "no request would hash to it"
    given = args.source
    if given is not None and given.lower().startswith("header:"):
        given = given.lower()  # the policy's labels carry header names in lower case
    labels: tuple[str, ...] | None = policy.identity_labels if policy is not None else None
    if labels is None:
        if given is not None:
            return str(given)
        print(warning_line(command, f"hashing the identity for the rule {DEFAULT_SOURCE} "
              "(the default --source); if the policy names customers by another rule (e.g. "
              f"header:authorization for a Bearer token) {outcome}: pass "
              "--source, or --policies to take it from the policy"), file=sys.stderr)
        return DEFAULT_SOURCE
    if given is None:
        if len(labels) > 1:
            print(f"extauthz {command}: hashing the identity for the rule {labels[0]}, the "
                  f"policy's first identity rule (--source for another: {', '.join(labels[1:])})",
                  file=sys.stderr)
        return labels[0]
    if source_problem(given, labels) is not None:
        raise CliError(f"--source {given}: the policy has no such identity rule (its identity "
                       f"rules: {', '.join(labels)}), so {never}")
    return str(given)


def _hashed_identity(args: argparse.Namespace, source: str, policy: Any) -> str:
    from ..policy.classify import AmbiguousKey, key_identity_hash

    flag = "KEY" if hasattr(args, "key") else "--identity"
    raw = sys.stdin.readline().rstrip("\r\n") if args.identity == "-" else args.identity
    if not raw:
        raise CliError(f"{flag} is empty")
    rule = next((s for s in policy.identity if s.label == source), None) if policy is not None else None
    if rule is None and source.startswith("header:"):  # no --policies: a header rule all the same
        from ..policy.model import IdentitySource

        rule = IdentitySource(header=source.removeprefix("header:"), strip_prefix=None, source_ip=False)
    try:
        return key_identity_hash(raw, rule, source, args.identity_salt.encode())
    except AmbiguousKey:
        raise CliError(f"{flag} holds different values separated by ',': the server reads such a "
                       "header as repeated with different values, never as one identity") from None


def _not_found(limiter: str, source: str) -> str:
    return (f"no override for limiter {limiter!r} and that identity (hashed for the identity "
            f"rule {source}; another --source or --identity-salt gives another hash: compare "
            "with `extauthz override list`)")


def _fmt_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _fmt_numbers(numbers: dict[str, float]) -> str:
    from ..control.changelog import format_number

    return " ".join(f"{k}={format_number(v)}" for k, v in sorted(numbers.items()))


def format_overrides(data: dict[str, Any]) -> str:
    from ..control.changelog import printable

    rows = data.get("overrides", [])
    if not rows:
        return f"no live overrides (at most {data.get('max', '?')})"
    out = [f"{len(rows)} live overrides (at most {data.get('max', '?')})",
           f"{'limiter':<20} {'identity':<26} {'numbers':<28} {'set by':<12} {'set at':<21} "
           f"{'expires':<21} {'applied':<8} reason"]
    for r in rows:
        applied = {True: "yes", False: "NO", None: "-"}[r.get("applied")]
        out.append(f"{r['limiter']:<20} {r['identity']:<26} {_fmt_numbers(r['numbers']):<28} "
                   f"{r['by'] or '-':<12} {_fmt_time(r['set_at']):<21} {_fmt_time(r['expires_at']):<21} "
                   f"{applied:<8} {r['reason']}")
        if r.get("not_applied"):
            out.append(f"  not applied: {r['not_applied']}")
    return "\n".join(printable(line) for line in out)  # rows read back from the store


def _load_policy(paths: list[str] | None) -> Any:
    if not paths:
        return None
    from ..policy import load_policy

    return load_policy(paths)

def cmd_override(args: argparse.Namespace) -> int:
    return _guarded(f"override {args.action}", lambda: _override(args))


def _override(args: argparse.Namespace) -> int:
    from ..control.overrides import make_override, parse_numbers, refuse_unapplied
    from ..limiters import build_limiters
    from ..store.keys import Keys

    if args.redis_url and (args.admin or args.listen):
        raise CliError("give either --redis-url or --admin/--listen, not both")
    args.redis_url = redis_url(args)
    _plain_text(str(getattr(args, "reason", "") or ""), str(getattr(args, "by", "") or ""))
    policy = _load_policy(args.policies)
    limiters = build_limiters(policy, Keys()) if policy is not None else None
    labels = policy.identity_labels if policy is not None else None
    source = ""
    identity = ""
    new: Override | None = None
    if args.action != "list":
        # the admin port checks the source against its policy; Redis has no policy to ask
        source = (_source(args, policy) if args.redis_url or policy is not None or args.source
                  else DEFAULT_SOURCE)
        identity = _hashed_identity(args, source, policy)
    if args.action == "set":
        kind = (next((s.type for s in policy.limiters if s.name == args.limiter), None)
                if policy is not None else None)
        new = make_override(args.limiter, identity, parse_numbers(args.numbers), ttl=args.ttl,
                            reason=args.reason, by=args.by, source=source, now=time.time(), kind=kind)
        if limiters is not None:  # refused here, before anything is sent
            refuse_unapplied(new, limiters, labels)

    async def go(control: Control) -> tuple[dict[str, Any] | None, str]:
        data: dict[str, Any] | None
        if new is not None:
            data = await control.set_override(new)
        elif args.action == "clear":
            data = await control.clear_override(args.limiter, identity)
        else:
            data = await control.overrides()
        return data, control.where

    data, where = _with_control(args, go, change=args.action != "list", limiters=limiters, labels=labels)
    if data is None:
        raise CliError(_not_found(args.limiter, source))
    if args.action == "list" and args.json:
        print(json.dumps(data, indent=2))
        return 0
    if new is not None:
        applies = ("every replica applies it within about two seconds" if args.redis_url
                   else f"applied by the server at {where} now")
        print(f"ok: {args.limiter} {_fmt_numbers(dict(new.numbers))} for identity {identity} "
              f"({source}) until {_fmt_time(new.expires_at)} ({applies})")
    elif args.action == "clear":
        print(f"ok: cleared {args.limiter} for identity {identity} on {where}")
    print(format_overrides(data))
    return 0


# -- hash and inspect ---------------------------------------------------------------------


def _key_hash(args: argparse.Namespace, command: str) -> tuple[str, str, Any]:
    """KEY (or '-': stdin) hashed as the server hashes it: the hash, the identity rule's
    label and the policy (None without --policies)."""
    policy = _load_policy(args.policies)
    source = _source(args, policy, command)
    args.identity = args.key
    return _hashed_identity(args, source, policy), source, policy


def cmd_hash(args: argparse.Namespace) -> int:
    return _guarded("hash", lambda: _hash(args))


def _hash(args: argparse.Namespace) -> int:
    identity, source, _ = _key_hash(args, "hash")
    print(identity)
    print(f"extauthz hash: identity rule {source}"
          f"{', salted' if args.identity_salt else ', no --identity-salt'}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    return _guarded("inspect", lambda: _inspect(args))


def _inspect(args: argparse.Namespace) -> int:
    from ..policy.classify import normal_hash

    if (args.key is None) == (args.identity_hash is None):
        raise CliError("give KEY (or '-' to read it from stdin) or --identity-hash HASH")
    if args.redis_url and (args.admin or args.listen):
        raise CliError("give either --redis-url or --admin/--listen, not both")
    if args.key is not None:
        identity, _, policy = _key_hash(args, "inspect")
    else:
        hashed, policy = normal_hash(args.identity_hash), _load_policy(args.policies)
        if hashed is None:  # not echoed: it may be a key given by mistake
            raise CliError("--identity-hash: not an identity hash (24 hex digits, as `extauthz hash` "
                           "prints; give a key as KEY, or '-' to read it from stdin)")
        identity = hashed
    limiters = None
    if policy is not None:
        from ..limiters import build_limiters
        from ..store.keys import Keys

        limiters = build_limiters(policy, Keys(args.key_prefix))

    async def go(control: Control) -> dict[str, Any]:
        return await control.customer(identity, args.plan)

    data = _with_control(args, go, limiters=limiters, labels=policy.identity_labels if policy else None,
                         policy=policy)
    print(json.dumps(data, indent=2) if args.json else format_customer(data))
    return 0


def _fmt_live(row: dict[str, Any]) -> str:
    live = row.get("live")
    if not live:
        return str(row.get("note", ""))
    if "tokens" in live:
        left = live.get("requests_left")
        text = (f"{live['tokens']:g} of {row['numbers']['burst']:g} tokens left"
                + (f" ({left} requests)" if left is not None else "") + f", full in {live['full_in']:.1f} s")
    elif "used" in live:
        text = (f"{live['used']:,} of {row['numbers']['limit']:,} used this window, "
                f"resets in {row['window']['resets_in']:.0f} s")
    else:
        text = f"{live['in_flight']} in flight of {row['numbers']['limit']}"
    if live.get("held_by_this_replica"):
        text += f"; {live['held_by_this_replica']:g} granted to this replica, unspent"
    return text


def format_customer(data: dict[str, Any]) -> str:
    """``extauthz inspect`` for people."""
    from ..control.changelog import printable

    lines = [f"identity {data['identity']} (policy version {data.get('policy_version', '?')}, "
             f"plan {data.get('plan') or '-'})"]
    for row in data.get("limiters", []):
        mode = row["mode"] + (f" (policy {row['policy_mode']})" if row["mode"] != row["policy_mode"] else "")
        head = f"  {row['limiter']:<22} {row['type']:<20} {mode:<10}"
        if row.get("numbers"):
            head += f" {_fmt_numbers(row['numbers'])} from {row['numbers_from']}"
        lines.append(head)
        over = row.get("override")
        if over:
            lines.append(f"      override {_fmt_numbers(over['numbers'])} until {_fmt_time(over['expires_at'])}"
                         f" ({over['reason'] or 'no reason'})"
                         + (f": NOT APPLIED, {over['not_applied']}" if over.get("not_applied") else ""))
        live = _fmt_live(row)
        if live:
            lines.append(f"      {live}")
    recent = data.get("recent_refusals") or {}
    refusals = recent.get("refusals")
    if refusals is None:
        lines.append(f"recent refusals: {recent.get('covers', 'unknown')}")
    elif not refusals:
        lines.append(f"recent refusals: none ({recent.get('covers', '')})")
    else:
        lines.append(f"recent refusals ({recent.get('covers', '')}):")
        for r in refusals[-10:]:
            lines.append(f"  {_fmt_time(r['at'])} {r['limiter']} {r['reason']} {r['outcome']}"
                         + ("" if r.get("enforced", True) else " (not enforced)")
                         + f" tier {r['tier']} status {r['status']}"
                         + (f" retry after {r['retry_after']:.1f} s" if r.get("retry_after") else ""))
    return "\n".join(printable(line) for line in lines)
