"""Builders for the observability tests: policies on disk, an in-process server with its
admin/metrics ports, Check calls over real gRPC, scraping and log capture."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from extauthz.core.clock import Clock, ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.observe.logs import JsonFormatter
from extauthz.policy.classify import hash_identity
from extauthz.proto import auth_pb2, auth_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.store.base import CheckResult, Op, Store
from extauthz.store.memory import MemoryStore

SALT = "test-salt"
IDENTITY = [{"header": "x-api-key"}, {"header": "authorization", "strip_prefix": "Bearer "},
            {"source_ip": True}]


class FlakyStore(MemoryStore):
    """The embedded store, except that it can fail (so it goes through the deadline path)."""

    immediate = False
    fail = False

    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        if self.fail:
            raise StoreUnavailable("down for the test")
        return await super().check(ops, lease_id)


def metrics_policy(tmp_path: Path, *extra: dict[str, Any]) -> Path:
    """A bucket, a shadow bucket, a fleet shedder and a worker shedder on a redis signal (and
    ``extra`` limiters): the policy of the metrics tests."""
    return write_policy(tmp_path / "p" / "api.yaml", [
        rate("user-rate", burst=3),
        rate("dark", burst=1, mode="shadow"),
        *extra,
        {"name": "fleet", "type": "fleet_usage", "capacity": 100, "reserved_for_critical": 0.2},
        {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
         "sample_interval": "60s", "good_below": 0.5, "bad_above": 0.6,
         "delay_before_shedding": "10s", "time_to_shed_all": "10s"},
    ], test_mode={"key_prefix": "sk_test_"})


async def shed_half(server: Server, store: MemoryStore, clock: ManualClock) -> None:
    """Drive the ``workers`` shedder of :func:`metrics_policy` to level 0.5: its signal reads
    1.0 for its 10 s delay and half of its 10 s ramp (the test tier is then shed entirely)."""
    from extauthz.limiters import WorkerUtilizationShedder
    from extauthz.limiters.worker import sample_once

    workers = next(w for w in server.engine.snapshot.workers if w.name == "workers")
    assert isinstance(workers, WorkerUtilizationShedder)
    await store.set_value(workers.signal_key, "1.0")
    for step in (0, 10, 5):
        clock.advance(step)
        await sample_once(server.engine, workers)


def write_policy(path: Path, limiters: list[dict[str, Any]], **extra: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"version": 1, "identity": IDENTITY, "limiters": limiters, **extra},
                                   sort_keys=False))
    return path


def rate(name: str, burst: float, *, mode: str = "enforce", rate_per_s: float = 0.001) -> dict[str, Any]:
    return {"name": name, "type": "request_rate", "rate": rate_per_s, "burst": burst, "mode": mode}


def identity_of(value: str, source: str = "header:x-api-key") -> str:
    return hash_identity(value, source, SALT.encode())


def check_request(path: str = "/v1/customers", method: str = "GET", headers: dict[str, str] | None = None,
                  request_id: str = "") -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method = method
    http.path = path
    http.host = "api.example.com"
    for k, v in (headers or {}).items():
        http.headers[k] = v
    if request_id:
        http.headers["x-request-id"] = request_id
    req.attributes.source.address.socket_address.address = "192.0.2.7"
    return req


class Client:
    """Check calls to an in-process server over a real gRPC channel."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = auth_pb2_grpc.AuthorizationStub(self.channel)

    async def check(self, key: str | None = "sk_live_alice", path: str = "/v1/customers", method: str = "GET",
                    headers: dict[str, str] | None = None, metadata: tuple[tuple[str, str], ...] = (),
                    request_id: str = "") -> int:
        """The HTTP status Envoy would give (200, 429, 503)."""
        h = dict(headers or {})
        if key is not None:
            h["x-api-key"] = key
        resp = await self.stub.Check(check_request(path, method, h, request_id), metadata=metadata or None,
                                     timeout=5)
        if resp.HasField("denied_response"):
            return int(resp.denied_response.status.code)
        return 200

    async def close(self) -> None:
        await self.channel.close()


@asynccontextmanager
async def running(policies: list[Path] | None = None, *, store: Store | None = None,
                  clock: Clock | None = None, tracer_provider: Any = None,
                  **config: Any) -> AsyncIterator[tuple[Server, Client]]:
    """A started Server (admin and metrics on free ports) and a Check client."""
    config = {"admin_listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", **config}
    cfg = ServerConfig(policies=[str(p) for p in (policies or [])], listen="127.0.0.1:0",
                       identity_salt=SALT, **config)
    server = Server(cfg, store=store, clock=clock if clock is not None else ManualClock(),
                    tracer_provider=tracer_provider)
    port = await server.start()
    client = Client(port)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(grace=0)


def _open(method: str, url: str, body: str | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, data=None if body is None else body.encode(),
                                 headers=headers or {})
    try:
        with opener.open(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def http(method: str, url: str, body: str | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, str]:
    """An HTTP call from a thread (the servers under test run on this loop)."""
    return await asyncio.to_thread(_open, method, url, body, headers)


async def admin(server: Server, method: str, path: str, body: str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """An admin call as the extauthz commands make it (with the X-Extauthz-Client header)."""
    status, text = await http(method, f"http://127.0.0.1:{server.ports.admin_port}{path}", body,
                              {"X-Extauthz-Client": "tests", **(headers or {})})
    return status, json.loads(text)


async def scrape(server: Server) -> str:
    status, text = await http("GET", f"http://127.0.0.1:{server.ports.metrics_port}/metrics")
    assert status == 200
    return text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return parsed[(name, frozenset(labels.items()))]


async def eventually(predicate: Callable[[], Any], within: float = 3.0, interval: float = 0.02) -> Any:
    """Poll an (async or sync) predicate until it is truthy; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(interval)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextmanager
def json_logs() -> Iterator[list[str]]:
    """Every log line (JSON, as ``extauthz serve`` writes them) emitted in the block."""
    handler = _Lines()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
