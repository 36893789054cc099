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


def require_tools(kinds: Sequence[str] = ("wrk", "h2load")) -> None:
    missing = [t for t in kinds if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run scripts/install-system-deps.sh "
                         "(Debian packages wrk, nghttp2-client)")


def wrk_script(workdir: Path, users: int = USERS) -> Path:
    """A wrk script cycling through ``users`` API keys (requests built once, in init)."""
    path = workdir / "users.lua"
    path.write_text(f"""
local reqs = {{}}
local n = {users}
local i = 0
init = function(args)
  for k = 1, n do
    reqs[k] = wrk.format("GET", "{PATH}", {{["x-api-key"] = "bench-user-" .. k}})
  end
  i = math.random(n) - 1
end
request = function()
  i = i % n + 1
  return reqs[i]
end
""")
    return path


def wrk_cmd(url: str, seconds: float, script: Path, *, threads: int, connections: int) -> list[str]:
    return ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", str(script),
            url + PATH]


def run_wrk(url: str, seconds: float, script: Path, *, threads: int, connections: int) -> dict[str, float]:
    """One wrk run: requests, seconds, req/s, non-2xx responses and socket errors."""
    cmd = wrk_cmd(url, seconds, script, threads=threads, connections=connections)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if m is None:
        raise RuntimeError(f"cannot read wrk output:\n{out}")
    secs = float(m.group(2)) * (0.001 if m.group(3) == "ms" else 1.0)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests": int(m.group(1)),
        "seconds": secs,
        "rps": int(m.group(1)) / secs if secs else 0.0,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "errors": sum(int(x) for x in sock.groups()) if sock else 0,
    }


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
