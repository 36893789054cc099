"""The test stack's port picker hands a port out once per process (devtools/stack.py)."""

from __future__ import annotations

import socket

import pytest

from extauthz.devtools import stack


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may give back-to-back binds of port 0 the same port (a server's public and
    # admin ports were once equal on CI). Planted: the kernel answers the same port three times.
    real_socket = socket.socket
    answers = iter([40001, 40001, 40001, 40002])

    class Kernel:
        def __init__(self) -> None:
            self.sock = real_socket()

        def __enter__(self) -> Kernel:
            return self

        def __exit__(self, *exc: object) -> None:
            self.sock.close()

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(answers)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    monkeypatch.setattr(stack.socket, "socket", Kernel)
    assert [stack.free_port(), stack.free_port()] == [40001, 40002]


def test_real_ports_are_distinct_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    ports = [stack.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free: nothing kept it


def test_a_port_block_skips_ports_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_HANDED_OUT", {30002})
    # bases 30000-30003 can be drawn; only 30003's block (30003-30006) misses 30002
    assert stack.free_port_block(4, low=30000, high=30008) == 30003
    assert set(range(30003, 30007)) <= stack._HANDED_OUT
    with pytest.raises(RuntimeError, match="no block of 4 free ports"):
        stack.free_port_block(4, low=30000, high=30008)
