"""The cost of one store check's ops outside Redis: the embedded store's check and the Redis
wire's packing and decoding (issue 30, "one table of op kinds").

    python bench/op_table.py                    # wall clock, 5 interleaved rounds
    python bench/op_table.py --instructions     # + instructions per check (callgrind)
    python bench/op_table.py --figures memory:default,wire:default   # some figures only

Before/after: run it against another tree with ``PYTHONPATH=/path/to/other/tree python
bench/op_table.py`` (only :meth:`MemoryStore.check_now`, ``wire.check_args`` and
``wire.check_results`` are used, which every tree since the op kinds has).

Mixes (users rotating over ``--users`` hashed identities, an injected clock moving 1 ms a
check so buckets refill and leases expire as in a server):

  default   the default policy's three: a token bucket, a user's lease, a fleet lease
  quota     a quota window's count and a token bucket
  grants    batched grants: a bucket grant and a quota grant (asked every check here)
  fleet     a fleet grant's renewal (three replicas' grants on one fleet key)
  returns   a bucket give-back and a quota give-back

``memory`` is ``MemoryStore.check_now`` (what the HTTP door's check costs in the store);
``wire`` is the Redis store's ``check_args`` (ARGV packing) plus ``check_results`` (the
answers derived from a canned reply), the Redis round trip excluded.

Wall clock: microseconds per check, the minimum over ``--rounds`` interleaved rounds (the
machine is shared: the minimum is the least disturbed). ``--instructions`` runs each figure
under ``valgrind --tool=callgrind`` twice (``--checks`` and twice as many) and prints the
difference per check, which leaves start-up and imports out.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extauthz.core.clock import ManualClock
from extauthz.store.base import (
    BucketOp,
    CountOp,
    FleetGrantOp,
    GrantOp,
    LeaseOp,
    Op,
    QuotaGrantOp,
    QuotaReturnOp,
    ReturnOp,
)
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import wire

KEYS = Keys()
HOUR = 3600


def identity(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:24]


#: mix -> the ops of one user's check
MIXES: dict[str, Callable[[str], list[Op]]] = {
    "default": lambda who: [BucketOp(KEYS.bucket("user-rate", who), 100.0, 500.0, 1.0),
                            LeaseOp(KEYS.user_leases("user-conc", who), 20, 60.0),
                            LeaseOp(KEYS.fleet_leases("fleet", "other"), 0, 60.0)],
    "quota": lambda who: [CountOp(KEYS.quota("hourly", who, 0), 1_000_000, 1, HOUR, 1800.0),
                          BucketOp(KEYS.bucket("user-rate", who), 100.0, 500.0, 1.0)],
    "grants": lambda who: [GrantOp(KEYS.bucket("batched", who), 100.0, 500.0, 1.0, 10.0, True, 0.5),
                           QuotaGrantOp(KEYS.quota("batched-q", who, 0), 1_000_000, 1, 10, HOUR, 1800.0,
                                        True, 0)],
    "fleet": lambda who: [FleetGrantOp(KEYS.fleet_leases("fleet-g", "other"), 0, 30.0, f"g{int(who, 16) % 3}", 4, 0,
                                       False, 1)],
    "returns": lambda who: [ReturnOp(KEYS.bucket("batched", who), 100.0, 500.0, 0.5),
                            QuotaReturnOp(KEYS.quota("batched-q", who, 0), 3)],
}
FIGURES = [f"{part}:{mix}" for part in ("memory", "wire") for mix in MIXES]


def workload(figure: str, checks: int, users: int) -> Callable[[], None]:
    """A function running ``checks`` checks of ``figure`` (the ops built beforehand)."""
    part, mix = figure.split(":")
    who = [identity(i) for i in range(users)]
    calls = [MIXES[mix](who[i % users]) for i in range(checks)]
    if part == "memory":
        clock = ManualClock()
        store = MemoryStore(clock)

        def run_memory() -> None:
            for i, ops in enumerate(calls):
                clock.advance(0.001)
                store.check_now(ops, f"r{i}")

        return run_memory

    replies: list[list[Any]] = [[1, *[x for _ in ops for x in (1, b"5")]] for ops in calls]

    def run_wire() -> None:
        for i, ops in enumerate(calls):
            wire.check_args("", ops, f"r{i}")
            wire.check_results(ops, replies[i], True)

    return run_wire


def wall_clock(figures: list[str], checks: int, users: int, rounds: int) -> dict[str, float]:
    best = {f: float("inf") for f in figures}
    for _ in range(rounds):
        for figure in figures:
            run = workload(figure, checks, users)
            t0 = time.perf_counter()
            run()
            best[figure] = min(best[figure], (time.perf_counter() - t0) / checks * 1e6)
    return best


def _callgrind_ir(figure: str, checks: int, users: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--only", figure, "--checks", str(checks), "--users", str(users)],
            capture_output=True, text=True, timeout=1800)
        match = re.search(r"Collected : (\d+)", proc.stderr) or re.search(r"refs:\s+([\d,]+)", proc.stderr)
        if proc.returncode != 0 or match is None:
            raise SystemExit(f"callgrind failed:\n{proc.stderr[-2000:]}")
        return int(match.group(1).replace(",", ""))


def instructions(figures: list[str], checks: int, users: int) -> dict[str, float]:
    return {f: (_callgrind_ir(f, 2 * checks, users) - _callgrind_ir(f, checks, users)) / checks
            for f in figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checks", type=int, default=20_000)
    p.add_argument("--users", type=int, default=1_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--instructions", action="store_true", help="also count instructions (valgrind)")
    p.add_argument("--instruction-checks", type=int, default=2_000)
    p.add_argument("--figures", default=",".join(FIGURES), help="which, comma-separated (default: all)")
    p.add_argument("--only", choices=FIGURES, help=argparse.SUPPRESS)  # the measured child
    a = p.parse_args()
    if a.only:
        workload(a.only, a.checks, a.users)()
        return
    import extauthz
    print(f"tree: {Path(extauthz.__file__).resolve().parents[1]}")
    figures = a.figures.split(",")
    if unknown := set(figures) - set(FIGURES):
        raise SystemExit(f"unknown figures: {', '.join(sorted(unknown))} (known: {', '.join(FIGURES)})")
    best = wall_clock(figures, a.checks, a.users, a.rounds)
    counted = {}
    if a.instructions:
        if shutil.which("valgrind") is None:
            raise SystemExit("--instructions needs valgrind")
        counted = instructions(figures, a.instruction_checks, a.users)
    for figure in figures:
        extra = f"  {counted[figure]:10,.0f} instructions" if figure in counted else ""
        print(f"{figure:16} {best[figure]:7.2f} us/check{extra}")


if __name__ == "__main__":
    main()
