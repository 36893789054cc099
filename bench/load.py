"""The load tools: ``wrk`` (saturated throughput) and ``h2load`` (latency at a fixed rate),
their command lines and their output."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

PATH = "/v1/items"
USERS = 1000
LATENCY_KEY = "bench-latency-user"
#: the flood configurations (bench/configs.py ``load``): the flooding key, and the prefix of
#: the well-behaved keys that take its place in the run without it
FLOOD_KEY = "bench-flood-user"
CALM_PREFIX = "bench-calm-user-"
#: the hot-key configurations (``load: "hot"``): every request carries this one key
HOT_KEY = "bench-hot-user"


def require_tools(kinds: Sequence[str] = ("wrk", "h2load")) -> None:
    missing = [t for t in kinds if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run scripts/install-system-deps.sh "
                         "(Debian packages wrk, nghttp2-client)")


def wrk_script(workdir: Path, users: int = USERS, *, name: str = "users.lua", prefix: str = "bench-user-",
               flood_key: str | None = None, rate: float | None = None) -> Path:
    """A wrk script cycling through ``users`` API keys ``<prefix>1..N`` (requests built once,
    in init). ``flood_key``: every other request carries that one key instead (``users=0``:
    every request). ``rate``: paced at that many requests/s (per wrk thread: run it with
    ``-t1``; each request is scheduled from a monotonic clock, read through LuaJIT's FFI, and
    sent on the next free connection). Its ``done`` prints the latency percentiles
    (:func:`read_wrk_latency`)."""
    path = workdir / name
    flood = "nil" if flood_key is None else f'wrk.format("GET", "{PATH}", {{["x-api-key"] = "{flood_key}"}})'
    pacing = "" if rate is None else f"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} bench_timespec;
int clock_gettime(int clk, bench_timespec *tp);
]]
local ts = ffi.new("bench_timespec")
local interval = {1000.0 / rate!r}
local due = nil
delay = function()
  ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  local now = tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
  if due == nil or due < now - 1000 then due = now end
  local wait = due - now
  due = due + interval
  if wait < 0 then return 0 end
  return wait
end
"""
    path.write_text(f"""
local reqs = {{}}
local n = {users}
local flood = nil
local i = 0
local sent = 0
init = function(args)
  for k = 1, n do
    reqs[k] = wrk.format("GET", "{PATH}", {{["x-api-key"] = "{prefix}" .. k}})
  end
  flood = {flood}
  if n > 0 then i = math.random(n) - 1 end
end
request = function()
  sent = sent + 1
  if flood ~= nil and (n == 0 or sent % 2 == 0) then
    return flood
  end
  i = i % n + 1
  return reqs[i]
end
{pacing}
done = function(summary, latency, requests)
  io.write(string.format("LATENCY_US p50 %d p99 %d p999 %d\\n", latency:percentile(50),
                         latency:percentile(99), latency:percentile(99.9)))
end
""")
    return path


def wrk_cmd(url: str, seconds: float, script: Path, *, threads: int, connections: int) -> list[str]:
    return ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", str(script),
            url + PATH]


def run_wrk(url: str, seconds: float, script: Path, *, threads: int, connections: int) -> dict[str, float]:
    """One wrk run: requests, seconds, req/s, non-2xx responses and socket errors (and the
    latency percentiles, :func:`read_wrk_latency`)."""
    cmd = wrk_cmd(url, seconds, script, threads=threads, connections=connections)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    return read_wrk(out)


def run_wrk_pair(url: str, seconds: float, scripts: tuple[Path, Path], *,
                 connections: int) -> tuple[dict[str, float], dict[str, float]]:
    """Two wrk processes at once (one thread each, e.g. two paced scripts): the figures of
    each (:func:`read_wrk`), so that one load's latency is read apart from the other's."""
    procs = [subprocess.Popen(wrk_cmd(url, seconds, script, threads=1, connections=connections),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for script in scripts]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode:
            raise RuntimeError(f"wrk exited {proc.returncode}:\n{out}\n{err}")
        outs.append(out)
    return read_wrk(outs[0]), read_wrk(outs[1])


def read_wrk(out: str) -> dict[str, float]:
    """:func:`run_wrk`'s figures from wrk's output."""
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h)\b", out)
    if m is None:
        raise RuntimeError(f"cannot read wrk output:\n{out}")
    # wrk prints the run's length in its largest whole unit ("10.01s", "11.00m")
    secs = float(m.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(3)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    lat = read_wrk_latency(out)
    return {
        **lat,
        "requests": int(m.group(1)),
        "seconds": secs,
        "rps": int(m.group(1)) / secs if secs else 0.0,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "errors": sum(int(x) for x in sock.groups()) if sock else 0,
    }


def read_wrk_latency(out: str) -> dict[str, float]:
    """p50/p99/p99.9 in ms from the line :func:`wrk_script`'s ``done`` prints (wrk's own
    histogram: from a request's write to its response; empty if absent)."""
    m = re.search(r"LATENCY_US p50 (\d+) p99 (\d+) p999 (\d+)", out)
    if m is None:
        return {}
    return {"p50_ms": int(m.group(1)) / 1000, "p99_ms": int(m.group(2)) / 1000,
            "p999_ms": int(m.group(3)) / 1000}


def h2load_cmd(url: str, seconds: float, log_file: Path, *, rate: int | None, clients: int,
               h1: bool = False) -> list[str]:
    cmd = ["h2load", "-D", str(max(1, round(seconds))), "--log-file", str(log_file),
           "-H", f"x-api-key: {LATENCY_KEY}", "-c", str(clients)]
    if rate is not None:
        per_client = max(1, rate // clients)
        cmd += ["-m", "32", "--rps", str(per_client)]
    else:
        cmd += ["-m", "1"]
    if h1:
        cmd.append("--h1")
    return [*cmd, url + PATH]


def read_h2load_log(path: Path) -> list[tuple[int, int, int]]:
    """(start us since epoch, HTTP status, duration us) per finished request."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0].isdigit():
            rows.append((int(parts[0]), int(parts[1]), int(parts[2])))
    rows.sort()
    return rows
