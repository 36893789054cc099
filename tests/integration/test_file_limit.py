"""A real ``extauthz serve`` under a low file limit (``RLIMIT_NOFILE`` 256, set in the
child): more kept-alive connections on the HTTP port than it has descriptors must not take
the ones the admin port and a policy reload need. Before the bound followed the file limit
(4,096 fixed), the idle connections exhausted descriptors: the admin port stopped accepting
and reloads failed to open the policy file."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from extauthz.devtools.stack import free_port, wait_for_health

NOFILE = 256
CONNECTIONS = NOFILE + 50  # more than the server has descriptors
POLICY = ("version: 1\nidentity: [{{header: x-api-key}}]\nlimiters:\n"
          "  - {{name: user-rate, type: request_rate, rate: 0.001, burst: {burst}}}\n")
REQUEST = b"GET /v1/customers HTTP/1.1\r\nHost: api.example.com\r\nx-api-key: sk_live_idle\r\n\r\n"


def _low_file_limit() -> None:  # runs in the child, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def admin_status(port: int) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
        assert resp.status == 200
        out: dict[str, Any] = json.loads(resp.read())
        return out


def eventually(predicate: Any, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if result:
            return result
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.1)


def test_idle_connections_leave_descriptors_for_the_admin_port_and_a_reload(tmp_path: Path) -> None:
    policy = tmp_path / "p" / "api.yaml"
    policy.parent.mkdir()
    policy.write_text(POLICY.format(burst=1000))
    grpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "extauthz", "serve", "--policies", str(policy.parent),
           "--listen", f"127.0.0.1:{grpc_port}", "--http-listen", f"127.0.0.1:{http_port}",
           "--admin-listen", f"127.0.0.1:{admin_port}", "--admin-url-file", "off"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_low_file_limit)
    clients: list[socket.socket] = []
    try:
        wait_for_health(grpc_port, 30, proc, log_path)
        first = admin_status(admin_port)["policy"]["version"]
        for _ in range(CONNECTIONS):  # each sends a check and keeps the connection open
            s = socket.create_connection(("127.0.0.1", http_port), timeout=5)
            clients.append(s)
            try:
                s.sendall(REQUEST)
            except OSError:
                pass  # refused and closed already: what the bound does

        def settled() -> dict[str, Any] | None:
            http = admin_status(admin_port)["http"]
            refused = http["rejected"].get("too_many_connections", 0)
            return http if http["connections"] + refused == CONNECTIONS else None

        http = settled() or eventually(settled)  # the admin port answers throughout
        assert http["connections"] < NOFILE
        assert http["max_connections"] == NOFILE - 128  # a quarter of 256 is below the 128 kept

        policy.write_text(POLICY.format(burst=5))  # a reload still opens the file

        def reloaded() -> dict[str, Any] | None:
            status = admin_status(admin_port)
            return status if status["policy"]["version"] != first else None

        status = eventually(reloaded)
        assert status["reload"]["failures"] == 0, (status["reload"], log_path.read_text()[-3000:])
    finally:
        for s in clients:
            s.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_default_bound_follows_the_file_limit() -> None:
    from extauthz.server.http import max_connections_for

    assert max_connections_for(1024) == 768  # a common container limit: a quarter kept
    assert max_connections_for(256) == 128  # at least 128 kept
    assert max_connections_for(65536) == 4096  # never above the fixed bound
    assert max_connections_for(resource.RLIM_INFINITY) == 4096
    assert max_connections_for(100) == 1
