"""``python -m bench.accesslog_flush`` runs end to end (real Envoy, server, Redis, wrk, h2load)
and its slot probe really watches the leases. No timing assertions: figures are only checked
for being there and consistent."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.accesslog_flush import ROWS, setup_for
from bench.procs import find_redis_server

ROOT = Path(__file__).resolve().parents[2]


def test_flush_intervals_map_to_harness_rows() -> None:
    assert setup_for(0).accesslog_flush_ms == 0  # each entry at once
    assert setup_for(5).key == ROWS[5.0] and setup_for(5).accesslog_flush_ms == 5
    other = setup_for(2.5)
    assert (other.accesslog_flush_ms, other.policy, other.redis) == (2.5, "all-on", True)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("h2load") is None or find_redis_server() is None,
                    reason="wrk/h2load/redis-server not installed (scripts/install-system-deps.sh)")
def test_short_run_samples_slot_hold_times(tmp_path: Path) -> None:
    out = tmp_path / "flush.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.accesslog_flush", "--flush", "0,5", "--rounds", "1", "--duration", "2",
         "--warmup", "0.5", "--deadline-ms", "500", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["flush_ms"] for r in results] == [0.0, 5.0]
    for r in results:
        assert r["rps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0, r
        assert r["samples"] > 0, r
        assert r["seen_held"] > 0, r  # the probe found its leases in Redis before they went
        assert 0 <= r["held_p50_ms"] <= r["held_p99_ms"] <= r["held_max_ms"], r
        assert r["timed_out"] == 0, r  # every lease was released (by the access log)
    assert "| 5 ms | 4,096 |" in proc.stdout  # the table
