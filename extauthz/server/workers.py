"""``extauthz serve --workers N``: N server processes sharing one port (SO_REUSEPORT).

The parent binds nothing: it starts N children (``python -m extauthz.server.workers``), each a
complete server (its own event loop, engine and store client) listening on the same port
with ``grpc.so_reuseport`` on, waits until every child is serving, and then supervises:
SIGTERM or SIGINT is forwarded to every child (each stops gracefully: NOT_SERVING, finishes
in-flight calls); a child that exits on its own stops the others and the parent exits 1, so
that the orchestrator restarts the whole set.

What to know:

* The kernel spreads *connections*, not requests. Envoy keeps one HTTP/2 connection to the
  extauthz cluster per Envoy worker thread, so N server workers only help behind an Envoy
  with at least N worker threads (``--concurrency``), and even then the spread of a few
  long-lived connections over N processes is random (two connections land on one process
  half the time with N = 2). More Envoy threads (or several Envoys) even it out.
* The embedded store is per process: N workers would each enforce the whole limit. So
  ``--workers`` above 1 needs ``--redis-url`` (refused otherwise).
* ``--worker-ports``: child ``i`` listens on the ``--listen`` port plus ``i`` instead (no
  SO_REUSEPORT): N processes on N ports, listed as N endpoints of Envoy's extauthz cluster,
  so that Envoy itself spreads its connections and requests over them (see
  docs/operations.md, "Several processes"). The ranges of Check, admin and metrics ports
  must not overlap (refused otherwise).
* Each child gets its own admin and metrics port: child ``i`` listens on the configured
  port plus ``i`` (a configured port 0 stays 0), and writes its admin URL to
  ``admin-PORT-i.url`` (worker 0: ``admin-PORT.url``). The Check port itself must not be 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from ..core.settings import worker_env, worker_handover
from .app import ServerConfig, is_off, stop_budget
from .ports import parse_listen

log = logging.getLogger("extauthz.server")


class WorkersError(ValueError):
    """``--workers`` was asked for with options it cannot work with."""


def _port_of(listen: str) -> int:
    try:
        return parse_listen(listen)[1]
    except ValueError as exc:
        raise WorkersError(str(exc)) from None


def _offset(listen: str | None, i: int) -> str | None:
    """``host:port`` with ``port + i`` (port 0 stays 0: let the OS pick)."""
    if not listen or i == 0:
        return listen
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return listen
    return f"{host}:{int(port) + i}"


def child_config(config: ServerConfig, i: int, *, own_ports: bool = False, workers: int = 1) -> ServerConfig:
    """The configuration of worker ``i`` of ``workers``: shared Check (and HTTP) port (or,
    ``own_ports``, those ports plus ``i``), own admin/metrics ports, own recording directory
    (``DIR/worker-<i>``, an equal share of ``--record-max-bytes``) when there are several."""
    changes: dict[str, object] = {}
    if own_ports:
        changes["listen"] = _offset(config.listen, i)
        if config.http_listen and not is_off(config.http_listen):
            changes["http_listen"] = _offset(config.http_listen, i)
    else:
        changes["reuse_port"] = True
    if config.record_dir and workers > 1:  # a worker deletes only its own oldest files
        changes["record_dir"] = os.path.join(config.record_dir, f"worker-{i}")
        changes["record_max_bytes"] = max(1, config.record_max_bytes // workers)
    for name in ("admin_listen", "metrics_listen"):
        changes[name] = _offset(getattr(config, name), i)
    url_file = config.admin_url_file
    if url_file and i:  # admin-PORT.url for worker 0, admin-PORT-i.url for worker i
        base, dot, ext = url_file.rpartition(".")
        changes["admin_url_file"] = f"{base}-{i}.{ext}" if dot else f"{url_file}-{i}"
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def check_workers(config: ServerConfig, workers: int, *, own_ports: bool = False) -> None:
    if workers < 1:
        raise WorkersError("--workers must be at least 1")
    if workers == 1:
        return
    if not config.redis_url:
        raise WorkersError(
            "--workers above 1 needs --redis-url: the embedded store is per process, so "
            f"{workers} workers would each enforce the whole limit"
        )
    for flag, listen in (("--listen", config.listen), ("--http-listen", config.http_listen)):
        if listen and not is_off(listen) and _port_of(listen) == 0:
            raise WorkersError(f"--workers above 1 needs a fixed {flag} port (not 0) to share")
    if own_ports:
        ranges = [(name, _port_of(listen)) for name, listen in (
            ("--listen", config.listen), ("--http-listen", config.http_listen),
            ("--admin-listen", config.admin_listen), ("--metrics-listen", config.metrics_listen))
            if listen and not is_off(listen)]
        for n, (name, port) in enumerate(ranges):
            for other, port2 in ranges[n + 1:]:
                if port and port2 and abs(port - port2) < workers:
                    raise WorkersError(
                        f"--worker-ports: {name} and {other} ports {port} and {port2} are less "
                        f"than {workers} apart (worker i listens on each port + i)")


def _start_child(config: ServerConfig, i: int) -> tuple[subprocess.Popen[bytes], int]:
    read_fd, write_fd = os.pipe()
    child = child_config(config, i, own_ports=config.worker_ports, workers=config.workers)
    # the one Settings as JSON: a worker reads nothing else from its parent's options
    env = {**os.environ, **worker_env(child, write_fd)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "extauthz.server.workers"], env=env,
                                pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    finally:
        os.close(write_fd)
    return proc, read_fd


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + stop_budget(grace) + 2.0  # each worker's own stop, then a margin
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("worker %d did not stop in time: killing it", proc.pid)
            proc.kill()
            proc.wait()


def serve_workers(config: ServerConfig, *, startup_timeout: float = 60.0) -> int:
    """Run ``config.workers`` server processes on one port (``config.worker_ports``: on ports
    ``--listen`` + i) until SIGTERM/SIGINT; return the exit code. Each worker receives
    ``config`` (:func:`child_config`) and nothing else."""
    workers = config.workers
    check_workers(config, workers, own_ports=config.worker_ports)
    from ..policy import load_policy

    load_policy(config.policies, max_bytes=config.policy_max_bytes)  # a bad policy fails here, once
    if not config.lease_secret:
        # one lease-ticket key for all workers: an access-log entry may reach any of them
        config = dataclasses.replace(config, lease_secret=secrets.token_hex(32))
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: list[subprocess.Popen[bytes]] = []
    pending: dict[int, int] = {}  # ready pipe fd -> worker index
    try:
        for i in range(workers):
            proc, fd = _start_child(config, i)
            procs.append(proc)
            pending[fd] = i
        deadline = time.monotonic() + startup_timeout
        while pending and not stopping.is_set():
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                log.error("worker %d exited during startup (code %s)", dead[0], procs[dead[0]].returncode)
                return 1
            if time.monotonic() > deadline:
                log.error("workers not serving after %.0f s", startup_timeout)
                return 1
            ready, _, _ = select.select(list(pending), [], [], 0.2)
            for fd in ready:
                serving = os.read(fd, 1) == b"1"  # b"" when the child died first
                os.close(fd)
                i = pending.pop(fd)
                if not serving:
                    log.error("worker %d exited during startup (code %s)", i, procs[i].wait())
                    return 1
        if not stopping.is_set():
            log.info("%d workers serving on %s (pids %s)", workers, config.listen,
                     " ".join(str(p.pid) for p in procs))
        while not stopping.wait(0.2):
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                log.error("worker %d exited (code %s): stopping the others", dead[0],
                          procs[dead[0]].returncode)
                return 1
        log.info("stopping %d workers", workers)
        return 0
    finally:
        for fd in pending:
            os.close(fd)
        _stop_all(procs, config.grace_seconds)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _child_main() -> int:
    from ..core.errors import PolicyError
    from ..observe.logs import configure_logging
    from .app import serve

    config, ready_fd = worker_handover()
    # the same log lines as a single server (JSON by default), from every worker
    listener = configure_logging(config.log_level, config.log_format)

    def ready(port: int) -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    try:
        serve(config, on_ready=ready)
    except PolicyError as exc:
        print(f"extauthz: the policy has errors:\n{exc}", file=sys.stderr)
        return 2
    finally:
        listener.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
