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

#: the summary's figures ``--fail-on`` compares, and its operators
FIGURES = ("critical_refused", "refused", "refused_share", "customers_refused",
           "max_customer_refused_share")
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
_CONDITION = re.compile(r"\s*([a-z_]+)\s*(>=|<=|==|>|<)\s*([-+0-9.eE]+)\s*")
#: the exit status when a --fail-on condition holds (2 is a usage error)
FAIL_ON_STATUS = 3


@dataclass(frozen=True)
class Condition:
    """``--fail-on 'critical_refused > 0'``: a figure of the candidate's summary, an operator
    and a number."""

    figure: str
    op: str
    number: float

    @classmethod
    def parse(cls, text: str) -> Condition:
        m = _CONDITION.fullmatch(text)
        if m is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected FIGURE OP NUMBER, e.g. 'critical_refused > 0' "
                f"(OP one of {', '.join(OPERATORS)})")
        figure, op, number = m.groups()
        if figure not in FIGURES:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown figure {figure!r} (one of {', '.join(FIGURES)})")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {number!r} is not a finite number")
        return cls(figure, op, value)

    def holds(self, summary: Mapping[str, Any]) -> bool:
        return OPERATORS[self.op](float(summary[self.figure]), self.number)

    def __str__(self) -> str:
        return f"{self.figure} {self.op} {self.number:g}"


def identity_labels(path: str, policy: Any, salt: bytes) -> dict[str, str]:
    """``--identities FILE``: raw keys or names, one a line, hashed for each of the policy's
    identity rules with the salt, as the server hashes them: hash -> the line."""
    from ..classify import hash_identity, header_value

    labels: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        for rule in policy.identity:
            value = header_value(rule, raw) if rule.strip_prefix is not None else raw
            labels[hash_identity(value or raw, rule.label, salt)] = raw
    return labels


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="replay recorded traffic against a candidate policy on a virtual clock",
        description="Replay traffic (serve --record files, plain JSON lines, or Envoy's JSON "
        "access log) in time order through the server's own engine on the embedded store and "
        "a virtual clock, and say who the candidate policy would refuse.")
    p.add_argument("--policies", nargs="+", required=True, help="the candidate policy (files or directory)")
    p.add_argument("--traffic", nargs="+", required=True, help="traffic files (.jsonl, .jsonl.gz)")
    p.add_argument("--baseline", nargs="+", default=None,
                   help="a baseline policy to compare with (e.g. the live one)")
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
                   help="raw API keys or customer names, one a line: hashed with --identity-salt "
                   "for the policy's identity rules to name the rows of the report and the JSON "
                   "(without it only hashes are written)")
    p.add_argument("--fail-on", metavar="EXPR", action="append", type=Condition.parse, default=[],
                   help="exit 3 when a figure of the candidate's summary compares true, e.g. "
                   f"'critical_refused > 0' (repeatable; figures: {', '.join(FIGURES)}; "
                   "operators: > >= < <= ==)")
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
    from ..errors import PolicyError
    from ..policy import load_policy
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
    try:
        files = [TrafficFile(path) for path in args.traffic]
        signal = SignalSeries.load(args.signal) if args.signal else None
        labels = (identity_labels(args.identities, candidate, args.identity_salt.encode())
                  if args.identities else None)
    except (OSError, TrafficError) as exc:
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
    held = [c for c in args.fail_on if c.holds(summary)]
    for c in held:
        print(f"extauthz simulate: --fail-on '{c}' holds: {c.figure} = {summary[c.figure]:g}",
              file=sys.stderr)
    return FAIL_ON_STATUS if held else 0


def _text_summary(summary: dict[str, object], replay: object) -> str:
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
    diff = summary.get("difference")
    if isinstance(diff, dict):
        lines.append(f"vs baseline: {diff['refused_by_candidate_only']:,} requests of "
                     f"{diff['identities_refused_by_candidate_only']:,} identities refused by the "
                     f"candidate only; {diff['refused_by_baseline_only']:,} refused by the baseline only")
    return "\n".join(lines)
