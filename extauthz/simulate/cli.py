"""``extauthz simulate``: replay traffic against a candidate policy (and a baseline)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO

from ..errors import PolicyError


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
    p.add_argument("--top", type=int, default=10, help="identities listed in top_identities (default 10)")
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..policy import load_policy
    from .replay import Replay, SignalSeries
    from .traffic import BadLines, TrafficError, TrafficFile, read_traffic

    try:
        candidate = load_policy(args.policies)
        baseline = load_policy(args.baseline) if args.baseline else None
    except PolicyError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return 2
    if args.report:  # fail before a long replay, not after it
        from .report import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            print(f"extauthz simulate: {exc}", file=sys.stderr)
            return 2
    try:
        files = [TrafficFile(path) for path in args.traffic]
        signal = SignalSeries.load(args.signal) if args.signal else None
    except (OSError, TrafficError) as exc:
        print(f"extauthz simulate: {exc}", file=sys.stderr)
        return 2
    bad = BadLines(skip=args.skip_bad_lines)
    replay = Replay(candidate, baseline, seed=args.seed, salt=args.identity_salt.encode(),
                    series=bool(args.report), signal=signal)
    bar = ProgressBar(list(files), sys.stderr) if sys.stderr.isatty() and not args.no_progress else None
    try:
        replay.run(read_traffic(files, window=args.reorder_window, bad=bad), progress=bar)
    except TrafficError as exc:
        if bar is not None:
            bar.close()
        print(f"extauthz simulate: {exc}\n(use --skip-bad-lines to skip and count bad lines)",
              file=sys.stderr)
        return 2
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
    summary = replay.summary(args.top)
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
    return 0


def _text_summary(summary: dict[str, object], replay: object) -> str:
    from .replay import Replay

    assert isinstance(replay, Replay)
    lines = [f"replayed {summary['requests']:,} requests in {replay.elapsed:.2f} s "
             f"({replay.requests_per_second:,.0f} requests/s): {summary['allowed']:,} allowed, "
             f"{summary['refused']:,} refused"]
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
