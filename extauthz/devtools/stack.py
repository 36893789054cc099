"""A whole local stack: upstream, the extauthz server (a real process), and Envoy.

Used by ``extauthz demo``, the end-to-end tests and the benchmarks, so all three run the
same Envoy config (the generator's, as in ``envoy/envoy.yaml``) and the same server command.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ..engine.answers import PROTOCOLS
from ..envoy.blocks import Config
from ..policy import load_policy
from .envoy_config import local_render
from .envoy_process import EnvoyProcess
from .upstream import Upstream, start_upstream

#: Every port handed out in this process: a port is handed out once (two back-to-back binds
#: of port 0 once gave a test server the same public and admin port, and it refused to start).
_HANDED_OUT: set[int] = set()
_STRIPE_WIDTH = 100


def stripe_of(env: Mapping[str, str]) -> tuple[int, int]:
    """``(index, count)`` of pytest-xdist's worker ``gw<index>`` of ``count`` (its variables,
    which a process it starts inherits), else ``(0, 1)``."""
    worker, count = env.get("PYTEST_XDIST_WORKER", ""), env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(worker[2:]) < int(count):
        return int(worker[2:]), int(count)
    return 0, 1


#: this process's share of every port range when several processes pick ports at once (the
#: tests under pytest-xdist): ``(index, count)``, a block is handed out only from the hundreds
#: whose number is ``index`` modulo ``count``, so two workers never pick the same port between
#: one's check and its bind. Read from the environment, so that a process a worker starts
#: (``bench.harness --smoke`` in tests/bench, which picks its Redis and server ports) keeps to
#: the worker's hundreds too.
PORT_STRIPE: tuple[int, int] = stripe_of(os.environ)


def _in_stripe(port: int) -> bool:
    """Whether ``port`` is in this process's hundreds (:data:`PORT_STRIPE`)."""
    index, count = PORT_STRIPE
    return count == 1 or (port // _STRIPE_WIDTH) % count == index


def free_port() -> int:
    """A loopback port free now, not handed out before by this process, below the ephemeral
    range (so that no outgoing connection takes it before its user binds it)."""
    return free_port_block(1)


def free_port_block(n: int, low: int = 20000, high: int = 32000) -> int:
    """A port P with P..P+n-1 all free and none handed out before, below the usual ephemeral
    range (so that outgoing connections do not take them between this check and the bind)."""
    import random

    for _ in range(200 * PORT_STRIPE[1]):
        base = random.randrange(low, high - n + 1)
        block = range(base, base + n)
        if not (_in_stripe(base) and _in_stripe(base + n - 1)):
            continue
        if _HANDED_OUT.intersection(block):
            continue
        socks = []
        try:
            for port in block:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _HANDED_OUT.update(block)
        return base
    raise RuntimeError(f"no block of {n} free ports")


def wait_for_health(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None,
                    log: Path | None = None) -> None:
    """Block until the gRPC health service on ``port`` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log else ""
                raise RuntimeError(f"extauthz server exited with {proc.returncode}:\n{tail}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log else ""
                raise TimeoutError(f"extauthz server on port {port} not serving after {timeout} s\n{tail}")
            time.sleep(0.05)


class ServerProcess:
    """``python -m extauthz serve`` on a free port, with its log in a file.

    ``workers=N`` (N > 1): ``serve --workers N --worker-ports``, N processes on the ports
    ``port`` to ``port + N - 1`` (admin ports likewise from ``admin_port``); ``start`` returns
    once all N serve. They share limits through the store, so ``args`` must name a
    ``--redis-url``."""

    def __init__(self, policies: Sequence[str | Path], *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, port: int | None = None,
                 workdir: Path | None = None, workers: int = 1) -> None:
        self.workers = workers
        self.port = port or (free_port() if workers == 1 else free_port_block(workers))
        self.admin_port = free_port() if workers == 1 else free_port_block(workers)
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="extauthz-server-"))
        self.log_path = self.workdir / f"server-{self.port}.log"
        self.cmd = [
            sys.executable, "-m", "extauthz", "serve",
            "--policies", *map(str, policies),
            "--listen", f"127.0.0.1:{self.port}",
            "--admin-listen", f"127.0.0.1:{self.admin_port}",
            *(["--workers", str(workers), "--worker-ports"] if workers > 1 else []),
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Self:
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env)
        log.close()
        try:
            for i in range(self.workers):
                wait_for_health(self.port + i, timeout, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Stack:
    """Upstream + extauthz server process + Envoy, on free loopback ports.

    Envoy runs what ``extauthz envoy-config`` gives the server's policy with the quick start's
    routes (where the policy names the tier by key) and the access log on
    (:func:`~extauthz.devtools.envoy_config.local_render`): the shipped ``envoy/envoy.yaml``
    for ``policies/``. ``protocol="http"`` runs Envoy's HTTP authorization protocol
    (``serve --http-listen``) instead of gRPC; the access log still streams to the gRPC port.
    ``server_workers=N`` runs ``serve --workers N --worker-ports`` (``server_args`` must name
    a ``--redis-url``) and lists the N ports as N endpoints of Envoy's ``extauthz`` cluster.
    ``options`` are the generator's (:class:`extauthz.envoy.config.Options`), ``edit`` a last
    change to the config (see ``local_render``).
    """

    def __init__(self, policies: Sequence[str | Path], *, server_args: Sequence[str] = (),
                 server_env: dict[str, str] | None = None, envoy_concurrency: int = 1,
                 otel: tuple[str, int] | None = None, protocol: str = "grpc",
                 server_workers: int = 1, edit: Callable[[Config], None] | None = None, **options: Any) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        if server_workers > 1 and protocol != "grpc":
            raise ValueError("server_workers: only on the gRPC protocol")
        self.protocol = protocol
        self.http_port = 0
        self.policies = policies
        self.server_args = server_args
        self.server_env = server_env
        self.envoy_concurrency = envoy_concurrency
        self.otel = otel
        self.server_workers = server_workers
        self.edit = edit
        self.options = options
        self.upstream: Upstream | None = None
        self.server: ServerProcess | None = None
        self.envoy: EnvoyProcess | None = None

    def start(self) -> Self:
        try:
            self.upstream = start_upstream()
            args = list(self.server_args)
            if self.protocol == "http":
                self.http_port = free_port()
                args += ["--http-listen", f"127.0.0.1:{self.http_port}"]
            self.server = ServerProcess(self.policies, args=args, env=self.server_env,
                                        workers=self.server_workers).start()
            policy = load_policy(list(self.policies))
            options: dict[str, Any] = {
                "tracing": self.otel or ("127.0.0.1", free_port()), "access_log": "always",
                # the demo routes tag route metadata where the policy reads the tier, by key
                "quickstart_routes": all(isinstance(step, str) for step in policy.route_metadata[1]),
                "authz_endpoints": self.server_workers, **self.options}
            config = local_render(policy, protocol=self.protocol, grpc_port=self.server.port,
                                  http_port=self.http_port or None, upstream_port=self.upstream.port,
                                  edit=self.edit, **options)
            self.envoy = EnvoyProcess(config, concurrency=self.envoy_concurrency).start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.server is not None:
            self.server.stop()
        if self.upstream is not None:
            self.upstream.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
