"""Where the server's time goes under saturated load: py-spy on the real server process.

For each configuration (default b, c, d of the harness) this starts the same stack as
``bench.harness``, drives it with wrk, records the server with ``py-spy record`` (sampling,
no instrumentation; ``--nonblocking`` so that the process is never paused) and prints the
share of samples per part of the server:

* ``gRPC + event loop (native)``: samples whose innermost Python frame is the event loop
  itself: gRPC's C core and Cython layer, uvloop, protobuf's C parsing/serializing;
* ``gRPC poller thread``: grpc.aio's separate polling thread;
* ``Check handler``: ``AuthorizationService.Check`` and all it calls (edge, classify,
  engine, limiters, store call, observers);
* ``access-log handler``: ``StreamAccessLogs`` and the releases it starts;
* ``store tasks``: the Redis store's sender tasks (pipelines, client, reply parsing);
* ``other Python``: background jobs and everything else.

It also prints the Python functions with the most self time, and writes the py-spy
flamegraphs (SVG) when ``--svg-dir`` is given. ``pip install py-spy`` (the bench extra).

    python -m bench.profile [--configs b,c,d] [--seconds 10] [--svg-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from extauthz.devtools.stack import free_port

from .configs import SETUPS, Options
from .load import run_wrk, wrk_cmd, wrk_script
from .procs import RedisServer
from .stack import Running

CATEGORIES = ("gRPC + event loop (native)", "gRPC poller thread", "Check handler",
              "access-log handler", "store tasks", "other Python")


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy (or the project's bench extra)")
    return found


def classify(stack: list[str]) -> str:
    thread = stack[0]
    frames = stack[1:]
    if "MainThread" not in thread:
        return "gRPC poller thread" if any("_poll_wrapper" in thread or "Thread.run" in f
                                             for f in stack) else "other Python"
    joined = ";".join(frames)
    if "Check (extauthz" in joined:
        return "Check handler"
    if "StreamAccessLogs" in joined or "Engine.release" in joined:
        return "access-log handler"
    if "store/redis/" in joined or "redis/asyncio" in joined or "redis/_parsers" in joined:
        return "store tasks"
    leaf = frames[-1] if frames else ""
    if leaf.startswith(("Runner.run", "run (uvloop", "run_until_complete")):
        return "gRPC + event loop (native)"
    return "other Python"


def summarize(raw: Path, top: int = 15) -> tuple[dict[str, float], list[tuple[str, float]]]:
    cats: collections.Counter[str] = collections.Counter()
    selfs: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        cats[classify(frames)] += n
        leaf = frames[-1]
        if "extauthz/" in leaf or "redis" in leaf or "asyncio/" in leaf or "protobuf" in leaf:
            selfs[leaf] += n
    total = max(1, total)
    return ({c: 100.0 * cats[c] / total for c in CATEGORIES},
            [(f, 100.0 * n / total) for f, n in selfs.most_common(top)])


def profile(key: str, seconds: float, svg_dir: Path | None, workdir: Path,
            redis: RedisServer | None) -> tuple[float, Path]:
    setup = SETUPS[key]
    opts = Options()
    script = wrk_script(workdir)
    running = Running(setup, redis if setup.redis else None, opts, workdir).start()
    raw = workdir / f"profile-{key}.txt"
    try:
        assert running.server is not None and running.server.proc is not None
        pid = running.server.proc.pid
        run_wrk(running.url, 2, script, threads=opts.threads, connections=opts.connections)
        load = subprocess.Popen(wrk_cmd(running.url, seconds + 3, script, threads=1, connections=opts.connections),
                                stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        spy = [_py_spy(), "record", "--pid", str(pid), "--duration", str(round(seconds)),
               "--rate", "250", "--nonblocking", "--threads"]
        subprocess.run([*spy, "--format", "raw", "--output", str(raw)], capture_output=True, check=True)
        if svg_dir is not None:
            svg_dir.mkdir(parents=True, exist_ok=True)
            # a second, shorter recording for the picture
            subprocess.run([*spy[:-4], "--duration", "3", "--rate", "250", "--nonblocking", "--threads",
                            "--output", str(svg_dir / f"profile-{key}.svg")], capture_output=True)
        out, _ = load.communicate()
        rps = float(out.split("Requests/sec:")[1].split()[0]) if "Requests/sec:" in out else 0.0
    finally:
        running.stop()
    return rps, raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="b,c,d")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--svg-dir", type=Path, default=None)
    p.add_argument("--raw-dir", type=Path, default=None,
                   help="keep py-spy's raw (collapsed) stacks here, profile-<config>.txt")
    a = p.parse_args(argv)
    keys = a.configs.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="extauthz-profile-"))
    redis = RedisServer(free_port(), workdir).start() if any(SETUPS[k].redis for k in keys) else None
    results = {}
    try:
        for key in keys:
            rps, raw = profile(key, a.seconds, a.svg_dir, workdir, redis)
            results[key] = (rps, *summarize(raw))
            if a.raw_dir is not None:
                a.raw_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(raw, a.raw_dir / raw.name)
    finally:
        if redis is not None:
            redis.stop()
    header = "| share of server samples | " + " | ".join(f"({k}) {SETUPS[k].label}" for k in keys) + " |"
    print(header)
    print("|---|" + "---:|" * len(keys))
    print("| saturated req/s during the recording | " + " | ".join(f"{results[k][0]:,.0f}" for k in keys) + " |")
    for cat in CATEGORIES:
        print(f"| {cat} | " + " | ".join(f"{results[k][1][cat]:.1f} %" for k in keys) + " |")
    for k in keys:
        print(f"\nTop Python self time, ({k}) {SETUPS[k].label}:")
        for fn, share in results[k][2]:
            print(f"  {share:5.1f} %  {fn}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
