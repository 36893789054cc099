"""``extauthz/server/workers.py``: what each worker process is given (no process started here)."""

from __future__ import annotations

import os

import pytest

from extauthz.core.settings import Settings
from extauthz.server.workers import child_config


@pytest.mark.parametrize("own_ports", [False, True])
def test_each_worker_records_into_its_own_directory(own_ports: bool) -> None:
    """--workers 3 --record DIR (with or without --worker-ports): worker i records into
    DIR/worker-i with a third of --record-max-bytes, so no worker deletes another's files."""
    config = Settings(listen="0.0.0.0:9001", admin_listen="127.0.0.1:9101", redis_url="redis://x",
                      record_dir="/var/rec", record_max_bytes=30_000, workers=3, worker_ports=own_ports)
    children = [child_config(config, i, own_ports=own_ports, workers=3) for i in range(3)]
    assert [(c.record_dir, c.record_max_bytes) for c in children] == [
        (os.path.join("/var/rec", f"worker-{i}"), 10_000) for i in range(3)]
    assert [c.listen for c in children] == (
        ["0.0.0.0:9001", "0.0.0.0:9002", "0.0.0.0:9003"] if own_ports else ["0.0.0.0:9001"] * 3)
    assert all(c.reuse_port is not own_ports for c in children)
