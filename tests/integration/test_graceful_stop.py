"""A server process stopped by SIGTERM with calls in flight on both ports: every call is
answered, the access-log stream Envoy keeps open is ended and answered, and the stop's budget
(what the chart's terminationGracePeriodSeconds is sized on: tests/helm/test_chart.py) is the
one the server computes and logs."""

from __future__ import annotations

import concurrent.futures
import http.client
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc, auth_pb2_grpc
from extauthz.server.app import ServerConfig, stop_budget
from extauthz.server.grpc_h2 import H2Limits
from testinfra.redis_servers import RedisSingle

from .test_server import check_request

#: a store call waits this long on the paused Redis before failing open (ms): the calls are
#: still in flight when SIGTERM arrives, and end well inside the stop's grace (5 s)
STORE_DEADLINE_MS = 2500
CALLS = 4


def http_check(port: int, key: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/customers", headers={"x-api-key": key, "connection": "close"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_sigterm_with_both_ports_busy_answers_every_call_within_the_budget(
        tmp_path: Path, grpc_server_kind: str, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: rate, type: request_rate, rate: 1000, burst: 1000}\n")
    http_port = free_port()
    proc = ServerProcess([policy], workdir=tmp_path, args=[
        "--grpc-server", grpc_server_kind, "--http-listen", f"127.0.0.1:{http_port}",
        "--redis-url", redis_single_clean.url, "--store-deadline-ms", str(STORE_DEADLINE_MS),
        "--check-budget-ms", str(2 * STORE_DEADLINE_MS)]).start()
    assert proc.proc is not None
    pool = concurrent.futures.ThreadPoolExecutor(CALLS + 1)
    paused = False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
            stub = auth_pb2_grpc.AuthorizationStub(ch)
            assert stub.Check(check_request(), timeout=10).status.code == 0
            assert http_check(http_port, "sk_live_warm") == 200
            # Envoy's access-log stream: open for the whole run (the stop ends it)
            sent, finish = threading.Event(), threading.Event()

            def entries() -> Iterator[accesslog_pb2.StreamAccessLogsMessage]:
                msg = accesslog_pb2.StreamAccessLogsMessage()
                msg.http_logs.log_entry.add().request.request_id = "r"
                yield msg
                sent.set()
                finish.wait(30)

            stream = accesslog_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs.future(entries(), timeout=30)
            assert sent.wait(10)
            # the store hangs: every check now waits for its store deadline, in flight
            redis_single_clean.pause()
            paused = True
            grpc_calls = [stub.Check.future(check_request(key=f"sk_live_g{i}"), timeout=30) for i in range(CALLS)]
            http_calls = [pool.submit(http_check, http_port, f"sk_live_h{i}") for i in range(CALLS)]
            # they reached the server (its accept and read) and wait on the store
            concurrent.futures.wait(http_calls, timeout=STORE_DEADLINE_MS / 2000)
            assert not any(c.done() for c in grpc_calls + http_calls)  # type: ignore[operator]
            proc.proc.send_signal(signal.SIGTERM)
            # each call in flight on either port is answered (allowed: the store failed open)
            assert [c.result(timeout=30).status.code for c in grpc_calls] == [0] * CALLS
            assert [c.result(timeout=30) for c in http_calls] == [200] * CALLS
            redis_single_clean.resume()
            paused = False
            if grpc_server_kind == "asyncio":  # grpc.aio cancels a stream still open at its grace's end
                assert isinstance(stream.result(timeout=30), accesslog_pb2.StreamAccessLogsResponse)
            finish.set()
        budget = stop_budget(ServerConfig().grace_seconds,
                             H2Limits().close_linger if grpc_server_kind == "asyncio" else 0.0)
        assert proc.proc.wait(budget + 30) == 0  # a bound against a hang, not a speed
        said = re.findall(r"finishing in-flight calls within ([0-9.]+) s", proc.log())
        assert said == [f"{budget:.1f}"], proc.log()[-2000:]
    finally:
        if paused:
            redis_single_clean.resume()
        pool.shutdown(wait=False, cancel_futures=True)
        proc.stop()
