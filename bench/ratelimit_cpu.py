"""The server's CPU per ``ShouldRateLimit`` against its CPU per rate-only ``Check`` (issue 32's
target: no more than 1.2x), on one gRPC door, the same limiter behind both.

The server runs as its own process (``extauthz serve``, the embedded store unless
``--redis-url``) with one token bucket per API key for ``Check`` and the same numbers behind
a descriptor ``[api_key]`` for ``ShouldRateLimit`` (1,000 keys, the peer table's shape: one
descriptor per API key). A grpc.aio client in this process sends ``--calls`` of each,
``--concurrency`` at a time on one channel (as Envoy multiplexes on one connection), after a
warm-up; the figure is the server's user + system CPU from ``/proc`` over the measured calls
only, divided by the calls. Run it on a quiet machine; it prints figures, it asserts nothing.

``--grpc-server asyncio`` is the default server (server/grpc_h2.py); ``grpcio`` is grpc.aio.
Three runs on the default, embedded store, 2026-11-29 (machine load about 1): 1.06, 1.03, 1.07.

    python -m bench.ratelimit_cpu [--calls 20000] [--concurrency 32] [--grpc-server asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from extauthz.devtools.stack import free_port
from extauthz.proto import auth_pb2, auth_pb2_grpc, ratelimit_common_pb2, rls_pb2, rls_pb2_grpc

KEYS = 1000
POLICY = """\
version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: per-key, type: request_rate, rate: 1000000, burst: 1000000}
  - name: per-key-descriptor
    type: request_rate
    rate: 1000000
    burst: 1000000
    match: {domain: bench, descriptor: [{key: api_key}]}
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_request(i: int) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = "GET", "/v1/items", "api.example"
    http.headers.update({"x-api-key": f"key-{i % KEYS}", "user-agent": "bench", ":authority": "api.example"})
    return req


def rls_request(i: int) -> rls_pb2.RateLimitRequest:
    d = ratelimit_common_pb2.RateLimitDescriptor(
        entries=[ratelimit_common_pb2.RateLimitDescriptor.Entry(key="api_key", value=f"key-{i % KEYS}")])
    return rls_pb2.RateLimitRequest(domain="bench", descriptors=[d])


async def drive(call: Callable[[int], Any], calls: int, concurrency: int) -> None:
    counter = iter(range(calls))

    async def worker() -> None:
        for i in counter:
            await call(i)

    await asyncio.gather(*[worker() for _ in range(concurrency)])


async def measure(port: int, pid: int, calls: int, concurrency: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = auth_pb2_grpc.AuthorizationStub(channel).Check
        rls = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit
        checks = [check_request(i) for i in range(KEYS)]
        asks = [rls_request(i) for i in range(KEYS)]
        phases: list[tuple[str, Callable[[int], Any]]] = [
            ("check", lambda i: check(checks[i % KEYS], timeout=5)),
            ("should_rate_limit", lambda i: rls(asks[i % KEYS], timeout=5)),
        ]
        for name, call in phases * 2:  # each twice, interleaved: the second round is kept
            await drive(call, min(calls, 2000), concurrency)  # warm-up
            before, started = cpu_seconds(pid), time.perf_counter()
            await drive(call, calls, concurrency)
            out[f"{name}_cpu_us"] = (cpu_seconds(pid) - before) / calls * 1e6
            out[f"{name}_rps"] = calls / (time.perf_counter() - started)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--grpc-server", choices=("grpcio", "asyncio"), default="asyncio")
    p.add_argument("--redis-url", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "bench.yaml"
        policy.write_text(POLICY)
        port = free_port()
        cmd = [sys.executable, "-m", "extauthz", "serve", "--policies", str(policy), "--listen",
               f"127.0.0.1:{port}", "--grpc-server", args.grpc_server, "--admin-listen", "off",
               "--identity-salt", "bench"]
        if args.redis_url:
            cmd += ["--redis-url", args.redis_url]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXTAUTHZ_")}
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):  # ready when the port answers
                try:
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                        grpc.channel_ready_future(ch).result(timeout=0.2)
                    break
                except grpc.FutureTimeoutError:
                    continue
            figures = asyncio.run(measure(port, server.pid, args.calls, args.concurrency))
        finally:
            server.terminate()
            server.wait(10)
    for name, value in figures.items():
        print(f"{name:28} {value:10.1f}")
    print(f"{'cpu_ratio_rls_over_check':28} {figures['should_rate_limit_cpu_us'] / figures['check_cpu_us']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
