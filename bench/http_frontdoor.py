"""Which HTTP server for the HTTP authorization port: a no-op answer, measured with wrk.

Candidates, each answering every request 200 with one ``x-extauthz-tier`` header after
reading the request's headers:

  protocol   server/http.py's connection protocol (asyncio on httptools, uvloop) with the
             engine replaced by a constant answer: the same work as the two below
  extauthz   ``extauthz serve --http-listen`` with bench/policies/noop.yaml (every limiter
             off) and the gRPC port off: the protocol plus classification and the engine
  uvicorn    uvicorn (``--http httptools --loop uvloop``) with a no-op ASGI app
  granian    granian (Rust HTTP/1.1, one worker, ``--loop uvloop``) with the same ASGI app

Rounds alternate between candidates (the machine is shared and noisy: compare within a
round). Prints req/s and the server's CPU microseconds per request (from /proc). Needs wrk;
uvicorn and granian are skipped when not installed (``pip install -e '.[bench]'``).

    python -m bench.http_frontdoor [--seconds 5] [--rounds 3] [--connections 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from extauthz.devtools.stack import free_port

from .procs import cpu_seconds

NOOP_POLICY = Path(__file__).with_name("policies") / "noop.yaml"

ASGI_APP = '''
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"x-extauthz-tier", b"get"), (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
'''


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def command(name: str, port: int, appdir: Path) -> list[str] | None:
    py = sys.executable
    if name == "protocol":
        return [py, "-m", "bench.http_frontdoor", "--serve-protocol", str(port)]
    if name == "extauthz":
        return [py, "-m", "extauthz", "serve", "--policies", str(NOOP_POLICY), "--listen", "off",
                "--http-listen", f"127.0.0.1:{port}", "--admin-listen", "off", "--log-level", "warning"]
    if name == "uvicorn" and importlib.util.find_spec("uvicorn"):
        return [py, "-m", "uvicorn", "noop_app:app", "--app-dir", str(appdir), "--port", str(port),
                "--http", "httptools", "--loop", "uvloop", "--no-access-log", "--log-level", "warning"]
    if name == "granian" and importlib.util.find_spec("granian"):
        return [py, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
                "--workers", "1", "--loop", "uvloop", "--no-ws", "--no-log", "noop_app:app"]
    return None


def run_wrk(port: int, seconds: float, connections: int) -> float:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-H", "x-api-key: k",
                          f"http://127.0.0.1:{port}/v1/customers"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return float(m.group(1)) if m else 0.0


def all_cpu(pid: int) -> float:
    """CPU of the process and its children (granian runs its worker as a child)."""
    total = cpu_seconds(pid)
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        kids = []
    return total + sum(all_cpu(int(k)) for k in kids)


def measure(name: str, seconds: float, connections: int, appdir: Path) -> tuple[float, float] | None:
    port = free_port()
    cmd = command(name, port, appdir)
    if cmd is None:
        return None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=appdir if name == "granian" else Path(__file__).resolve().parents[1])
    try:
        wait_port(port)
        run_wrk(port, 1, connections)  # warm up
        cpu0 = all_cpu(proc.pid)
        rps = run_wrk(port, seconds, connections)
        cpu = all_cpu(proc.pid) - cpu0
        return rps, (cpu / (rps * seconds) * 1e6 if rps else 0.0)
    finally:
        proc.terminate()
        proc.wait(10)


def serve_protocol(port: int) -> None:
    """server/http.py's protocol answering every request with a constant 200."""
    import asyncio

    import uvloop

    from extauthz.server import http, httpmap

    answer = httpmap.head(200, [("x-extauthz-tier", "get")], 0, False)

    class NoopFlow:  # the check flow's place, answering at once
        async def check(self, door: object, message: object, call: object) -> bytes:
            return answer

    async def run() -> None:
        front = http.HttpAuthorization(NoopFlow())  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: http._Connection(front), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="one 1-second round")
    ap.add_argument("--serve-protocol", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_protocol:
        serve_protocol(args.serve_protocol)
        return 0
    if args.smoke:
        args.seconds, args.rounds = 1, 1
    if shutil.which("wrk") is None:
        print("wrk not found (scripts/install-system-deps.sh installs it)", file=sys.stderr)
        return 2
    names = ["protocol", "extauthz", "uvicorn", "granian"]
    with tempfile.TemporaryDirectory(prefix="extauthz-frontdoor-") as tmp:
        appdir = Path(tmp)
        (appdir / "noop_app.py").write_text(ASGI_APP)
        results: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                got = measure(name, args.seconds, args.connections, appdir)
                if got is not None:
                    results[name].append(got)
                    print(f"round {r + 1} {name:<9} {got[0]:>9.0f} req/s {got[1]:>7.1f} us CPU/request",
                          flush=True)
    print(f"\nmedian of {args.rounds} round(s), wrk -c{args.connections}, {args.seconds:g} s each:")
    for name, rows in results.items():
        if not rows:
            print(f"  {name:<9} not installed")
            continue
        rps = sorted(x[0] for x in rows)[len(rows) // 2]
        cpu = sorted(x[1] for x in rows)[len(rows) // 2]
        print(f"  {name:<9} {rps:>9.0f} req/s {cpu:>7.1f} us CPU/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
