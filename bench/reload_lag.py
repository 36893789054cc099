"""How long a policy reload holds the event loop (issue 29, defect 10).

A policy near the size bound (``--policy-max-bytes`` 1M): :func:`big_policy`'s 12,000
classification rules, 0.88 MiB. A :class:`~extauthz.engine.reload.PolicyWatcher` on a real loop
swaps it in for a one-rule policy (``poll``, the server's job) while a probe task sleeps
1 ms in a loop and records how late each wake-up came: the largest gap is how long a Check
would have waited. On a shared machine part of a gap is other processes' turn on the CPU;
the CPU this process's Python threads used within the gap (``busy``) is the part the reload
held. Each round
prints the reload's duration and CPU (this process and its child), the largest gap with
its busy part, and the 99th percentile of the gaps; then the medians over rounds.

    python -m bench.reload_lag [--rounds 3] [--rules 12000]

Before/after: run it once on this tree and once on another one with the same script
(``PYTHONPATH=/path/to/other/tree python bench/reload_lag.py``; the script uses only
``PolicyWatcher(...).poll`` and ``Engine``). The machine these run on is shared: compare
runs made one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extauthz.engine.reload import PolicyWatcher

SMALL = "version: 1\nlimiters:\n  - {name: user-rate, type: request_rate, rate: 100, burst: 500}\n"


def big_policy(rules: int = 12_000) -> str:
    """A valid policy of ``rules`` classification rules (12,000: 0.88 MiB, under the 1 MiB
    bound) and one limiter."""
    lines = ["version: 1", "identity:", "  - header: x-api-key", "classification:",
             "  route_metadata_namespace: extauthz", "  rules:"]
    for i in range(rules):
        lines.append(f"    - match: {{methods: [POST], path_prefix: /v1/ch/{i:05d}}}")
        lines.append(f"      tier: {'critical' if i % 2 else 'get'}")
    lines += ["limiters:", "  - name: user-rate", "    type: request_rate", "    rate: 100", "    burst: 500"]
    return "\n".join(lines) + "\n"


def cpu() -> float:
    """CPU seconds this process and its finished children have used (every thread)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass(frozen=True)
class Lag:
    #: the reload's duration, from the watcher's poll to the new policy swapped in (s)
    reload: float
    #: CPU the reload used, in this process and in a child (s)
    reload_cpu: float
    #: the loop's largest gap past the probe's 1 ms sleep while it ran (s)
    max_gap: float
    p99_gap: float
    #: the most CPU this process's Python threads used within one gap (s): the loop's (or
    #: another thread's holding the GIL) share of the gap, not the time the machine gave to
    #: other processes or to native threads
    max_busy: float
    #: probe wake-ups during the reload
    wakeups: int


def python_threads_cpu() -> dict[int, float]:
    """CPU seconds each of this process's Python threads has used (by thread id): the threads
    that can hold the GIL, and so the loop. Not native threads that never take it (gRPC's
    core has some), nor other processes."""
    used = {}
    for thread in threading.enumerate():
        if thread.ident is not None:
            try:
                used[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # it ended meanwhile
                pass
    return used


class Probe:
    """Sleeps 1 ms in a loop and records how late each wake-up came, and how much CPU this
    process's Python threads used meanwhile (the loop's thread, or another one holding the
    GIL; a thread that ended within the gap is not counted)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.busy: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while not self._stop.is_set():
            t, before = time.perf_counter(), python_threads_cpu()
            await asyncio.sleep(0.001)
            self.gaps.append(max(0.0, time.perf_counter() - t - 0.001))
            after = python_threads_cpu()
            self.busy.append(sum(c - before.get(ident, 0.0) for ident, c in after.items()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


async def reload_lag(directory: Path, text: str) -> tuple[Lag, PolicyWatcher]:
    """Swap the policy in ``directory`` (one file, small) for ``text`` through a watcher's
    ``poll`` while a :class:`Probe` runs: the loop's lag while it did, and the watcher."""
    from extauthz.engine.engine import Engine
    from extauthz.engine.reload import PolicyWatcher
    from extauthz.engine.storegate import StoreGate
    from extauthz.policy import load_policy
    from extauthz.store.memory import MemoryStore

    (directory / "api.yaml").write_text(SMALL)
    policy = load_policy([directory])
    engine = Engine(StoreGate(MemoryStore()), policy)
    watcher = PolicyWatcher([directory], engine.set_policy, current=policy)
    (directory / "api.yaml").write_text(text)
    gc.collect()  # as the server does once started (server/app.py run)
    gc.freeze()
    try:
        probe = Probe()
        probe.start()
        await asyncio.sleep(0.05)
        probe.gaps.clear()
        probe.busy.clear()
        start, start_cpu = time.perf_counter(), cpu()
        reloaded = await watcher.poll()
        took, took_cpu = time.perf_counter() - start, cpu() - start_cpu
        await probe.stop()
    finally:
        gc.unfreeze()
    if not reloaded:
        raise RuntimeError(f"the policy did not reload: {watcher.status()['last_error']}")
    gaps = sorted(probe.gaps)
    return Lag(took, took_cpu, gaps[-1], gaps[int(len(gaps) * 0.99)], max(probe.busy), len(gaps)), watcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rules", type=int, default=12_000)
    args = parser.parse_args()
    text = big_policy(args.rules)
    print(f"policy: {args.rules} rules, {len(text.encode()) / (1 << 20):.2f} MiB")
    runs = []
    for n in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            lag, _ = asyncio.run(reload_lag(Path(tmp), text))
        runs.append(lag)
        print(f"round {n + 1}: reload {lag.reload:.2f} s ({lag.reload_cpu:.2f} s CPU), largest loop gap "
              f"{lag.max_gap * 1000:.1f} ms (this process busy {lag.max_busy * 1000:.1f} ms of it), "
              f"p99 {lag.p99_gap * 1000:.1f} ms ({lag.wakeups} wake-ups)")
    print(f"median: reload {statistics.median(r.reload for r in runs):.2f} s, largest loop gap "
          f"{statistics.median(r.max_gap for r in runs) * 1000:.1f} ms (busy "
          f"{statistics.median(r.max_busy for r in runs) * 1000:.1f} ms), "
          f"p99 {statistics.median(r.p99_gap for r in runs) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
