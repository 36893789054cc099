"""Overload is decided, not timed out (extauthz/engine/overload.py), through a real server process
on both front doors: checks that queued while the server was stopped (SIGSTOP, a stall as
a starved CPU gives) get a decision when it runs again: the shedders refuse the non-critical
ones (503, reason ``overload``) without the store, the critical ones pass; and a gRPC call
with a deadline shorter than the budget on an idle server is decided as usual."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.engine.answers import PROBLEM_TYPE
from extauthz.envoy.headers import SHED_STATUS
from extauthz.proto import auth_pb2, auth_pb2_grpc

from .test_http_parity import check_request

#: a budget long enough that a slow machine answers the checks queued behind the stall in it
BUDGET_MS = 1500
POLICY = """\
version: 1
identity: [{header: x-api-key}]
classification:
  rules:
    - match: {methods: [POST], path_prefix: /v1/charges}
      tier: critical
limiters:
  - {name: user-rate, type: request_rate, rate: 1000, burst: 1000}
  - {name: fleet, type: fleet_usage, capacity: 16, reserved_for_critical: 0.25}
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    proc = ServerProcess([policy], workdir=tmp_path, args=[
        "--http-listen", f"127.0.0.1:{free_port()}", "--check-budget-ms", str(BUDGET_MS)])
    proc.http_port = int(proc.cmd[proc.cmd.index("--http-listen") + 1].rsplit(":", 1)[1])  # type: ignore[attr-defined]
    with proc:
        yield proc


def status(proc: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.admin_port}/status", timeout=10) as resp:
        doc: dict[str, Any] = json.load(resp)
        return doc


def http_check(port: int, method: str, path: str, key: str) -> tuple[int, str]:
    """One request on the HTTP authorization port (its own connection): status, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: api.example.com\r\nx-api-key: {key}\r\n"
                     f"connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def grpc_check(stub: auth_pb2_grpc.AuthorizationStub, method: str, path: str,
               timeout: float = 30.0) -> auth_pb2.CheckResponse:
    resp: auth_pb2.CheckResponse = stub.Check(check_request(method, path, "sk_live_u1"), timeout=timeout)
    return resp


def stalled(proc: ServerProcess, send: Callable[[], Future[Any]], n: int) -> list[Any]:
    """Stop the server, send ``n`` checks, keep it stopped past the budget's half (the
    starved threshold), let it go on; their answers."""
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        futures = [send() for _ in range(n)]
        time.sleep(BUDGET_MS / 1000 * 0.75)  # the stall (what is checked is its outcome)
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    return [f.result(timeout=60) for f in futures]


def wait_until(ok: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
def test_a_stalled_server_refuses_non_critical_checks_and_passes_critical_ones_grpc(
        server: ServerProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, ThreadPoolExecutor(8) as pool:
        stub = auth_pb2_grpc.AuthorizationStub(channel)
        assert grpc_check(stub, "GET", "/v1/x").status.code == 0  # warm: admitted

        answers = stalled(server, lambda: pool.submit(grpc_check, stub, "GET", "/v1/x"), 4)
        for resp in answers:  # non-critical: refused by the shedder, not left to time out
            assert resp.denied_response.status.code == 503, resp
            body = json.loads(resp.denied_response.body)
            assert (body["limiter"], body["type"]) == ("fleet", PROBLEM_TYPE + "overload"), body

        answers = stalled(server, lambda: pool.submit(grpc_check, stub, "POST", "/v1/charges"), 4)
        assert all(resp.status.code == 0 for resp in answers), answers  # critical: passes

        doc = status(server)
        assert doc["overload"]["checks"].get("get", 0) >= 4
        assert doc["overload"]["peak_lag_seconds"] >= BUDGET_MS / 1000 / 2
        assert doc["fail_open"].get("overload", 0) == 0  # nothing failed open: decided
        # the stall over (a budget later), non-critical checks are admitted again
        wait_until(lambda: grpc_check(stub, "GET", "/v1/x").status.code == 0, "admitted again")



def test_a_short_grpc_deadline_on_an_idle_server_is_decided_as_usual(server: ServerProcess) -> None:
    """A client's 30 ms deadline (shorter than the budget and than Envoy's 50 ms margin): the
    check is decided as usual within what it has (the margin is a quarter of it), never
    refused as overload. Calls the machine is too slow to answer in 30 ms end
    DEADLINE_EXCEEDED on the client: those decide nothing here; every answer must be a
    normal one, and one at least must come."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = auth_pb2_grpc.AuthorizationStub(channel)
        assert grpc_check(stub, "GET", "/v1/x").status.code == 0  # connected and warm
        answers = []
        for _ in range(50):
            try:
                answers.append(grpc_check(stub, "GET", "/v1/x", timeout=0.03))
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
            if len(answers) >= 3:
                break
        assert answers, "no 30 ms call answered in 50"
        for resp in answers:  # admitted, not refused as overload
            assert resp.status.code == 0, resp.denied_response.body
    doc = status(server)
    assert doc["fail_open"].get("overload", 0) == 0 and doc["overload"]["checks"] == {}, doc


@pytest.mark.slow
def test_a_stalled_server_refuses_non_critical_checks_and_passes_critical_ones_http(
        server: ServerProcess) -> None:
    port: int = server.http_port  # type: ignore[attr-defined]
    with ThreadPoolExecutor(8) as pool:
        assert http_check(port, "GET", "/v1/x", "sk_live_u1")[0] == 200
        answers = stalled(server, lambda: pool.submit(http_check, port, "GET", "/v1/x", "sk_live_u1"), 4)
        for code, body in answers:
            assert code == SHED_STATUS, (code, body)  # Envoy maps it to 503 (envoy-config)
            doc = json.loads(body)
            assert (doc["limiter"], doc["type"]) == ("fleet", PROBLEM_TYPE + "overload"), doc
        answers = stalled(server, lambda: pool.submit(http_check, port, "POST", "/v1/charges", "sk_live_u1"), 4)
        assert [code for code, _ in answers] == [200] * 4, answers
        assert status(server)["overload"]["checks"].get("get", 0) >= 4
