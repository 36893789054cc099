"""``extauthz simulate``: replay traffic against a candidate policy (and a baseline)."""

from __future__ import annotations

import argparse
import json
import math
import operator
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .identities import IdentityFile

#: the summary's figures ``--fail-on`` compares, and its operators
FIGURES = ("critical_refused", "refused", "refused_share", "customers_refused",
           "max_customer_refused_share")
#: one customer's figures (``--fail-on 'customer:HASH refused > 1%'``)
CUSTOMER_FIGURES = ("requests", "refused", "refused_share")
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
_CONDITION = re.compile(r"\s*(?:customer:(\S+)\s+)?([a-z_]+)\s*(>=|<=|==|>|<)\s*(.*?)\s*")
_NUMBER = re.compile(r"([-+0-9.eE]+)\s*(%?)")
_BASELINE = re.compile(r"baseline(?:\s*([+*])\s*([-+0-9.eE]+)\s*(%?))?")
#: the exit status when a --fail-on condition holds (2 is a usage error)
FAIL_ON_STATUS = 3
_USE = ("expected [customer:HASH_OR_NAME] FIGURE OP NUMBER[%] or FIGURE OP baseline[+N|*N], "
        "e.g. 'critical_refused > 0', 'customer:1f0c5a9e27b4d8c6a3e1f2b0 refused > 1%' (the 24-hex "
        "hash `extauthz hash` prints, or a NAME of the --identities file), "
        "'refused_share > baseline + 1%'")
#: what ``customer:X`` may be besides a hash (never a key: it would land in argv, shell history
#: and CI logs, and this command prints its conditions)
_NOT_A_KEY = ("customer:X takes the customer's identity hash (24 hex digits: `extauthz hash` prints it) "
              "or a NAME of the --identities file (NAME<TAB>KEY lines), never a key: a key given "
              "there lands in shell history and CI logs")


def _finite(text: str, number: str) -> float:
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: {number!r} is not a finite number")
    return value


@dataclass(frozen=True)
class Condition:
    """``--fail-on 'critical_refused > 0'``: a figure of the candidate's summary (or of one
    customer's traffic: ``customer:HASH_OR_NAME``, never a key), an operator, and a number or the same
    figure of the baseline (``baseline``, ``baseline + 0.01``, ``baseline * 1.1``). A number
    with ``%`` is a share (``refused > 1%``: ``refused_share > 0.01``)."""

    figure: str
    op: str
    number: float
    customer: str | None = None
    #: compare with the baseline's figure: ``baseline + number`` or ``baseline * number``
    against: str | None = None
    text: str = ""

    @classmethod
    def parse(cls, given: str) -> Condition:
        """Errors never echo the customer part unless it is a hash (it may be a key)."""
        m = _CONDITION.fullmatch(given)
        if m is None:
            raise argparse.ArgumentTypeError(f"{_shown(given)!r}: {_USE}")
        customer, figure, op, value = m.groups()
        text = _shown(given)
        if customer is not None:
            customer = normal_hash(customer) or customer
        known = CUSTOMER_FIGURES if customer is not None else FIGURES
        if figure not in known:
            whose = " for a customer" if customer is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r}: unknown figure {figure!r}{whose} (one of {', '.join(known)})")
        base, plain = _BASELINE.fullmatch(value), _NUMBER.fullmatch(value)
        if base is None and plain is None:
            raise argparse.ArgumentTypeError(f"{text!r}: {_USE}")
        against: str | None = None
        if base is not None:
            sign, number, percent = base.groups()
            against, amount = sign or "+", _finite(text, number) if number else 0.0
        else:
            number, percent = plain.groups()  # type: ignore[union-attr]
            amount = _finite(text, number)
        if percent:
            if figure == "refused":
                figure = "refused_share"
            elif not figure.endswith("share"):
                raise argparse.ArgumentTypeError(f"{text!r}: a % compares a share (refused or *_share), "
                                                 f"not {figure}")
            if against != "*":
                amount /= 100.0
        return cls(figure, op, amount, customer, against, " ".join(_CUSTOMER.sub("", given).split()))

    def limit(self, baseline: float | None) -> float:
        """The number the figure is compared with (``baseline``: the baseline's figure)."""
        if self.against is None:
            return self.number
        assert baseline is not None
        return baseline * self.number if self.against == "*" else baseline + self.number

    def holds(self, value: float, baseline: float | None = None) -> bool:
        return OPERATORS[self.op](float(value), self.limit(baseline))

    def __str__(self) -> str:
        """The condition as given, its customer as a hash or a NAME (:func:`Gate.resolve`
        refuses anything else before any output)."""
        rest = self.text or f"{self.figure} {self.op} {self.number:g}"
        return f"customer:{self.customer} {rest}" if self.customer is not None else rest


_CUSTOMER = re.compile(r"^\s*customer:\S+")


def normal_hash(value: str) -> str | None:
    """:func:`extauthz.policy.classify.normal_hash`, imported when used (the command line starts
    without the policy's models)."""
    from ...policy.classify import normal_hash

    return normal_hash(value)


def _shown(text: str) -> str:
    """``--fail-on`` text fit to print: a customer part that is not a hash hidden."""
    m = _CUSTOMER.match(text)
    if m is None or normal_hash(m.group(0).strip().removeprefix("customer:")) is not None:
        return text
    return "customer:<hidden> " + text[m.end():].lstrip()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="replay recorded traffic against a candidate policy on a virtual clock",
        description="Replay traffic (serve --record files, plain JSON lines, or Envoy's JSON "
        "access log) in time order through the server's own engine on the embedded store and "
        "a virtual clock, and say who the candidate policy would refuse.")
    p.add_argument("--policies", nargs="+", required=True, help="the candidate policy (files or directory)")
    p.add_argument("--traffic", nargs="+", required=True, help="traffic files (.jsonl, .jsonl.gz)")
    p.add_argument("--baseline", nargs="+", default=None, metavar="DIR",
                   help="a baseline policy to compare with (e.g. the live one), replayed beside the candidate")
    p.add_argument("--baseline-summary", metavar="FILE", default=None,
                   help="instead of --baseline: an earlier run's --json summary (a baseline run, e.g. "
                   "the live policy's from the main branch), for --fail-on '... baseline' conditions")
    p.add_argument("--json", dest="json_out", default=None, help="write the summary as JSON here ('-': stdout)")
    p.add_argument("--report", default=None, help="write report.md and PNG plots into this directory")
    p.add_argument("--signal", default=None,
                   help="utilization time series (JSON lines {time, value}) for worker shedders "
                   "whose signal source is redis or envoy_admin")
    p.add_argument("--seed", type=int, default=0, help="seed of the shedders' random draws (default 0)")
    p.add_argument("--identity-salt", default="",
                   help="identity hashing key, as the server's --identity-salt (plain/Envoy traffic)")
    p.add_argument("--reorder-window", type=float, default=120.0,
                   help="seconds lines may be out of start-time order within a file (default 120; "
                   "logs are written when requests finish)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip bad lines and count them (default: stop at the first, naming file:line)")
    p.add_argument("--top", type=int, default=10,
                   help="identities listed in top_identities and customers (default 10)")
    p.add_argument("--identities", metavar="FILE", default=None,
                   help="one customer a line, NAME<TAB>KEY (or the KEY alone): the key hashed with "
                   "--identity-salt for the policy's identity rules, the NAME shown in the rows of "
                   "the report and the JSON (a line with the key alone as 'line N'; a key is never "
                   "shown; without the file only hashes are written)")
    p.add_argument("--fail-on", metavar="EXPR", action="append", type=Condition.parse, default=[],
                   help="exit 3 when a figure of the candidate's summary compares true, e.g. "
                   f"'critical_refused > 0' (repeatable; figures: {', '.join(FIGURES)}; "
                   "operators: > >= < <= ==); one customer's: 'customer:HASH refused > 1%%' "
                   f"({', '.join(CUSTOMER_FIGURES)}); against the baseline (--baseline or "
                   "--baseline-summary): 'refused_share > baseline + 1%%', 'refused > baseline * 1.1'. HASH: the "
                   "24-hex identity hash `extauthz hash` prints, or a NAME of the --identities file; "
                   "never a key (it would land in shell history and CI logs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off when stderr is not a TTY)")


class ProgressBar:
    """A one-line stderr bar over the bytes of the traffic files read so far."""

    def __init__(self, files: list[object], stream: IO[str]) -> None:
        self.files = files
        self.stream = stream
        self.total = sum(getattr(f, "size", 0) for f in files) or 1
        self.started = time.perf_counter()

    def __call__(self, n: int) -> None:
        done = sum(getattr(f, "position", 0) for f in self.files) / self.total
        rate = n / max(1e-9, time.perf_counter() - self.started)
        width = 30
        fill = int(width * min(1.0, done))
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done:4.0%} {n:,} requests "
                          f"({rate:,.0f}/s)")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _error(message: object) -> int:
    """An error before or during the replay: the operator commands' one form, exit 2."""
    from ..opscli import error_line

    print(error_line("simulate", message), file=sys.stderr)
    return 2


def cmd_simulate(args: argparse.Namespace) -> int:
    from ...core.errors import PolicyError
    from ...policy import load_policy
    from .replay import Replay, SignalSeries
    from .traffic import BadLines, TrafficError, TrafficFile, read_traffic

    try:
        candidate = load_policy(args.policies)
        baseline = load_policy(args.baseline) if args.baseline else None
    except PolicyError as exc:
        for issue in exc.issues:
            _error(issue)
        return 2
    if args.report:  # fail before a long replay, not after it
        from .report import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            return _error(exc)
    try:  # the output directories, made before a long replay (a file in their way fails here)
        if args.json_out not in (None, "-"):
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        if args.report:
            Path(args.report).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _error(f"cannot make the output directory: {exc}")
    if args.baseline and args.baseline_summary:
        return _error("give --baseline DIR (a policy, replayed) or --baseline-summary FILE (an earlier "
                      "run's --json), not both")
    against = [c for c in args.fail_on if c.against is not None]
    if against and not (args.baseline or args.baseline_summary):
        return _error(f"--fail-on '{_shown(str(against[0]))}' compares with the baseline: give --baseline DIR "
                      "or --baseline-summary FILE")
    if args.baseline_summary and any(c.customer is not None for c in against):
        return _error("a customer's --fail-on against the baseline needs --baseline DIR (a "
                      "summary holds no per-customer figures for every customer)")
    try:  # the traffic files last: they stay open for the replay (closed as they are read)
        signal = SignalSeries.load(args.signal) if args.signal else None
        identities = (IdentityFile.read(args.identities, candidate, args.identity_salt.encode())
                      if args.identities else None)
        labels = identities.labels if identities is not None else None
    except (OSError, ValueError, TrafficError) as exc:
        return _error(exc)
    names: dict[str, set[str]] = {} if identities is None else identities.names
    for c in args.fail_on:  # before any output: a customer that is not a hash nor a NAME may be a key
        if c.customer is not None and normal_hash(c.customer) is None and c.customer not in names:
            return _error(f"--fail-on '{_shown(str(c))}': {_NOT_A_KEY}"
                          + ("" if identities is not None else " (no --identities file given)"))
    try:
        baseline_summary = _read_summary(args.baseline_summary) if args.baseline_summary else None
        files = [TrafficFile(path) for path in args.traffic]
    except (OSError, ValueError, TrafficError) as exc:
        return _error(exc)
    bad = BadLines(skip=args.skip_bad_lines)
    replay = Replay(candidate, baseline, seed=args.seed, salt=args.identity_salt.encode(),
                    series=bool(args.report), signal=signal)
    bar = ProgressBar(list(files), sys.stderr) if sys.stderr.isatty() and not args.no_progress else None
    try:
        replay.run(read_traffic(files, window=args.reorder_window, bad=bad), progress=bar)
    except TrafficError as exc:
        if bar is not None:
            bar.close()
        return _error(f"{exc}\n(use --skip-bad-lines to skip and count bad lines)")
    if bar is not None:
        bar.close()
    if bad.total:
        reasons = ", ".join(f"{n} {why}" for why, n in bad.by_reason.most_common())
        print(f"skipped {bad.total} bad lines ({reasons}); first: " + "; ".join(bad.examples),
              file=sys.stderr)
    for lane in replay.lanes:
        for name in lane.unsignalled:
            print(f"warning: {lane.name} shedder '{name}' reads a redis/envoy_admin signal and no "
                  "--signal was given: its utilization replays as 0 (it never sheds)", file=sys.stderr)
    if identities is not None:
        missing = identities.unmatched(replay.candidate.tally.identity_requests)
        if missing:
            print(f"warning: {len(missing)} of {len(identities.entries)} --identities entries match no "
                  f"request (another --identity-salt or identity rule, or no traffic): {identities.path} "
                  f"line{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}", file=sys.stderr)
    summary = replay.summary(args.top, labels)
    text = json.dumps(summary, indent=2)
    if args.json_out == "-":
        print(text)
    elif args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(_text_summary(summary, replay), file=sys.stderr if args.json_out == "-" else sys.stdout)
    if args.report:
        from .report import write_report

        out = write_report(Path(args.report), replay, summary, bad_lines=bad,
                           traffic=[str(p) for p in args.traffic])
        print(f"report: {out}", file=sys.stderr if args.json_out == "-" else sys.stdout)
    gate = Gate(replay, summary, baseline_summary or summary.get("baseline"), labels or {}, names)
    held = 0
    for c in args.fail_on:
        line = gate.check(c)
        if line is not None:
            held += 1
            print(f"extauthz simulate: --fail-on '{c}' holds: {line}", file=sys.stderr)
    return FAIL_ON_STATUS if held else 0


def _read_summary(path: str) -> dict[str, Any]:
    """``--baseline-summary FILE``: an earlier run's ``--json``, with every figure."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--baseline-summary {path}: not JSON ({exc})") from None
    lacking = [f for f in FIGURES if not isinstance(data, dict) or not isinstance(data.get(f), (int, float))]
    if lacking:
        raise ValueError(f"--baseline-summary {path}: not a simulate --json summary (no {', '.join(lacking)})")
    return dict(data)


@dataclass
class Gate:
    """Evaluates ``--fail-on`` conditions after the replay, and says why one holds, naming
    the customer it is about. ``baseline``: the baseline's summary (replayed, or an earlier
    run's); ``labels``: hash -> name (``--identities``)."""

    replay: Any
    summary: Mapping[str, Any]
    baseline: Mapping[str, Any] | None
    labels: Mapping[str, str]
    #: NAME -> hashes (``--identities``)
    names: Mapping[str, set[str]]

    def name(self, identity: str) -> str:
        label = self.labels.get(identity)
        return f"{label} ({identity})" if label else identity

    def _customer(self, given: str) -> str:
        """The identity hash ``customer:X`` names: a hash as given, else (a NAME of the
        --identities file) its key's hash for the identity rule that carried the most requests."""
        hashed = normal_hash(given)
        if hashed is not None:
            return hashed
        requests = self.replay.candidate.tally.identity_requests
        return max(sorted(self.names[given]), key=lambda h: requests.get(h, 0))

    @staticmethod
    def _figures(tally: Any, identity: str) -> dict[str, float]:
        n, refused = tally.identity_requests.get(identity, 0), tally.identity_refused.get(identity, 0)
        return {"requests": n, "refused": refused, "refused_share": refused / n if n else 0.0}

    def check(self, c: Condition) -> str | None:
        """None, or what held: the figure, the baseline's, and who."""
        if c.customer is not None:
            ident = self._customer(c.customer)
            mine = self._figures(self.replay.candidate.tally, ident)
            if not mine["requests"]:  # a typo, another salt: a gate that can never hold
                print(f"warning: --fail-on '{c}': no request of that customer in the traffic (another "
                      "--identity-salt or identity rule, or a mistyped hash)", file=sys.stderr)
            base_lane = self.replay.baseline
            theirs = self._figures(base_lane.tally, ident)[c.figure] if base_lane is not None else None
            if not c.holds(mine[c.figure], theirs):
                return None
            return (f"customer {self.name(ident)}: {c.figure} = {mine[c.figure]:g}"
                    + (f" (baseline {theirs:g})" if c.against is not None else "")
                    + f"; {mine['refused']:g} of {mine['requests']:g} requests refused")
        value = float(self.summary[c.figure])
        theirs = float(self.baseline[c.figure]) if c.against is not None and self.baseline is not None else None
        if not c.holds(value, theirs):
            return None
        return (f"{c.figure} = {value:g}" + (f" (baseline {theirs:g})" if theirs is not None else "")
                + self._who(c.figure))

    def _who(self, figure: str) -> str:
        """The customer behind a fleet-wide figure: the worst hit, or the most refused."""
        tally = self.replay.candidate.tally
        if figure == "critical_refused":
            by = {i: n for (i, tier), n in tally.identity_tier_refused.items() if tier == "critical"}
            if not by:
                return ""
            ident = max(sorted(by), key=by.__getitem__)
            return f"; most: customer {self.name(ident)} ({by[ident]:,} critical requests refused)"
        if not tally.identity_refused:
            return ""
        if figure == "max_customer_refused_share":
            ident = max(sorted(tally.identity_refused),
                        key=lambda i: tally.identity_refused[i] / tally.identity_requests[i])
            what = "worst hit"
        else:
            ident = max(sorted(tally.identity_refused), key=tally.identity_refused.__getitem__)
            what = "most refused"
        return (f"; {what}: customer {self.name(ident)} ({tally.identity_refused[ident]:,} of "
                f"{tally.identity_requests[ident]:,} requests refused)")


def _text_summary(summary: dict[str, object], replay: object) -> str:
    from .advice import describe_advice
    from .replay import Replay

    assert isinstance(replay, Replay)
    lines = []
    if summary["critical_refused"]:
        lines.append(f"CRITICAL TRAFFIC REFUSED: the candidate refuses {summary['critical_refused']:,} "
                     "critical requests")
    lines.append(f"replayed {summary['requests']:,} requests in {replay.elapsed:.2f} s "
                 f"({replay.requests_per_second:,.0f} requests/s): {summary['allowed']:,} allowed, "
                 f"{summary['refused']:,} refused")
    by_limiter = summary["by_limiter"]
    assert isinstance(by_limiter, dict)
    for name, row in by_limiter.items():
        mode = replay.candidate.policy.limiter(name)
        tag = f" ({mode.mode})" if mode is not None and mode.mode != "enforce" else ""
        lines.append(f"  {name}{tag}: refused {row['refused']:,} requests of {row['identities']:,} identities")
    customers = summary.get("customers")
    for row in customers if isinstance(customers, list) else ():
        for name, numbers in (row.get("would_admit") or {}).items():
            who = f"{row['label']} ({row['identity']})" if row.get("label") else row["identity"]
            lines.append(f"  {who}: {name} would admit all {row['requests']:,} of its requests with "
                         + describe_advice(numbers))
    diff = summary.get("difference")
    if isinstance(diff, dict):
        lines.append(f"vs baseline: {diff['refused_by_candidate_only']:,} requests of "
                     f"{diff['identities_refused_by_candidate_only']:,} identities refused by the "
                     f"candidate only; {diff['refused_by_baseline_only']:,} refused by the baseline only")
    return "\n".join(lines)

