"""``extauthz serve --workers N``: N processes on one port, one budget on Redis, graceful stop."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from bench.procs import children, established_by_pid, free_port_block
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.proto import auth_pb2_grpc
from extauthz.server.app import ServerConfig
from extauthz.server.workers import WorkersError, check_workers, child_config
from testinfra.redis_servers import RedisSingle

from .test_server import check_request

POLICY = "version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n" \
         "  - {name: user-rate, type: request_rate, rate: 0.001, burst: 4}\n"


def test_workers_need_redis_and_a_fixed_port() -> None:
    check_workers(ServerConfig(listen="127.0.0.1:0"), 1)
    with pytest.raises(WorkersError, match="--redis-url"):
        check_workers(ServerConfig(listen="127.0.0.1:9001"), 2)
    with pytest.raises(WorkersError, match="fixed --listen port"):
        check_workers(ServerConfig(listen="127.0.0.1:0", redis_url="redis://x"), 2)
    with pytest.raises(WorkersError, match="fixed --http-listen port"):
        check_workers(ServerConfig(listen="off", http_listen="127.0.0.1:0", redis_url="redis://x"), 2)
    check_workers(ServerConfig(listen="off", http_listen="127.0.0.1:9003", redis_url="redis://x"), 2)
    with pytest.raises(WorkersError, match="at least 1"):
        check_workers(ServerConfig(), 0)


def test_child_config_shares_the_port_and_offsets_admin() -> None:
    config = ServerConfig(listen="0.0.0.0:9001", admin_listen="127.0.0.1:9002", metrics_listen="0.0.0.0:0")
    c1 = child_config(config, 1)
    assert c1.reuse_port and c1.listen == "0.0.0.0:9001"
    assert c1.admin_listen == "127.0.0.1:9003" and c1.metrics_listen == "0.0.0.0:0"
    assert child_config(config, 0).admin_listen == "127.0.0.1:9002"


def test_cli_refuses_workers_without_redis(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    proc = subprocess.run([sys.executable, "-m", "extauthz", "serve", "--policies", str(policy),
                           "--listen", f"127.0.0.1:{free_port()}", "--workers", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs --redis-url" in proc.stderr


@pytest.mark.redis
@pytest.mark.slow
def test_two_workers_share_one_port_and_one_budget(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    # worker i serves admin on the given port + i: a block of free ports below the ephemeral range
    admin = f"127.0.0.1:{free_port_block(2)}"
    # A generous store deadline: a Check that misses the 5 ms default (a fresh worker's first
    # Redis connection on a loaded machine) fails open and is admitted past the shared budget.
    server = ServerProcess([policy], args=["--workers", "2", "--redis-url", redis_single_clean.url,
                                           "--admin-listen", admin, "--store-deadline-ms", "2000"],
                           workdir=tmp_path)
    server.start(timeout=60)
    try:
        assert server.proc is not None
        deadline = time.monotonic() + 30
        while "2 workers serving" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        pids = children(server.proc.pid)
        assert len(pids) == 2
        # Several channels (connections) until both workers have answered some.
        allowed = 0
        channels = [grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(16)]
        try:
            for ch in channels:
                resp = auth_pb2_grpc.AuthorizationStub(ch).Check(check_request("sk_live_shared"), timeout=5)
                allowed += resp.HasField("ok_response")
            by_pid = established_by_pid(server.port, pids)
        finally:
            for ch in channels:
                ch.close()
        assert all(n > 0 for n in by_pid.values()), by_pid  # both workers took connections
        assert allowed == 4  # one budget on Redis for both workers: burst 4, no refill to speak of
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        # every worker logs the same JSON lines as a single server ("serving on port ...")
        serving = [json.loads(line) for line in server.log().splitlines()
                   if line.startswith("{") and '"serving on port' in line]
        assert len(serving) == 2, server.log()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        server.stop()


def test_worker_ports_give_each_worker_its_own_check_port() -> None:
    config = ServerConfig(listen="0.0.0.0:9001", admin_listen="127.0.0.1:9101",
                          metrics_listen="0.0.0.0:0")
    c1 = child_config(config, 1, own_ports=True)
    assert not c1.reuse_port and c1.listen == "0.0.0.0:9002" and c1.admin_listen == "127.0.0.1:9102"
    assert child_config(config, 0, own_ports=True).listen == "0.0.0.0:9001"
    check_workers(dataclasses.replace(config, redis_url="redis://x"), 4, own_ports=True)
    # Check ports 9001..9004 would run into admin ports 9002..9005.
    crowded = ServerConfig(listen="0.0.0.0:9001", admin_listen="127.0.0.1:9002", redis_url="redis://x")
    with pytest.raises(WorkersError, match="less than 4 apart"):
        check_workers(crowded, 4, own_ports=True)
    check_workers(crowded, 4)  # one shared Check port: no overlap


@pytest.mark.redis
@pytest.mark.slow
def test_two_workers_on_two_ports(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    """--workers 2 --worker-ports: each worker answers Checks on its own port (N endpoints
    of Envoy's cluster), one budget on Redis."""
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    base = free_port_block(2)
    admin = f"127.0.0.1:{free_port_block(2)}"
    server = ServerProcess([policy], port=base, workdir=tmp_path, args=[
        "--workers", "2", "--worker-ports", "--redis-url", redis_single_clean.url,
        "--admin-listen", admin])
    server.start(timeout=60)
    try:
        assert server.proc is not None
        deadline = time.monotonic() + 30
        while "2 workers serving" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        allowed = 0
        for port in (base, base + 1, base, base + 1, base, base + 1):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                resp = auth_pb2_grpc.AuthorizationStub(ch).Check(check_request("sk_live_shared"), timeout=5)
                allowed += resp.HasField("ok_response")
        assert allowed == 4  # burst 4 shared through Redis by both ports
    finally:
        server.stop()
