"""The test stack's port picker (devtools/stack.py): a port is handed out once per process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from extauthz.devtools import stack


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # two back-to-back binds of port 0 once gave a server the same public and admin port (CI)
    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    monkeypatch.setattr(stack, "PORT_STRIPE", (0, 1))
    ports = [stack.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)  # below the ephemeral range
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing kept it


def test_a_port_block_skips_ports_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_HANDED_OUT", {30002})
    monkeypatch.setattr(stack, "PORT_STRIPE", (0, 1))
    # bases 30000-30004 can be drawn; only 30003's block (30003-30006) and 30004's miss 30002
    base = stack.free_port_block(4, low=30000, high=30008)
    assert base in (30003, 30004)
    assert set(range(base, base + 4)) <= stack._HANDED_OUT
    with pytest.raises(RuntimeError, match="no block of 4 free ports"):
        stack.free_port_block(4, low=30000, high=30008)


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    monkeypatch.setattr(stack, "PORT_STRIPE", (0, 1))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="no block of 1 free ports"):
            stack.free_port_block(1, low=port, high=port + 1)


def test_a_stripe_hands_out_only_its_own_hundreds(monkeypatch: pytest.MonkeyPatch) -> None:
    # two pytest-xdist workers pick ports at once: worker 1 of 2 only from the odd hundreds
    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    monkeypatch.setattr(stack, "PORT_STRIPE", (1, 2))
    ports = [stack.free_port() for _ in range(200)] + [stack.free_port_block(3) for _ in range(50)]
    assert all((p // 100) % 2 == 1 for p in ports)
    assert all(((p + 2) // 100) % 2 == 1 for p in ports[200:])  # a block stays in one stripe
    with pytest.raises(RuntimeError, match="no block of 1 free ports"):
        stack.free_port_block(1, low=30000, high=30100)  # an even hundred: none of worker 1's


def test_a_process_a_worker_starts_keeps_to_the_worker_s_stripe() -> None:
    # tests/bench start bench.harness --smoke, bench.accesslog_flush and bench.fleet_cluster as
    # child processes, which pick their Redis and server ports with free_port: from the
    # worker's hundreds too, or they can take a port the other worker has just checked
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    code = ("import json; from extauthz.devtools import stack; "
            "print(json.dumps([stack.PORT_STRIPE, [stack.free_port() for _ in range(100)]]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stripe, ports = json.loads(out.stdout)
    assert stripe == [1, 2]
    assert all((p // 100) % 2 == 1 for p in ports)
    alone = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    out = subprocess.run([sys.executable, "-c", code], env=alone, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)[0] == [0, 1]  # outside pytest-xdist: every hundred

