"""bench/simulate_bench.py runs and prints its figures (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_simulate_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "bench.simulate_bench", "--requests", "3000", "--rounds", "1",
                           "--profile", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for name in ("file", "replay", "replay_asyncio", "baseline"):
        assert data[name]["cpu_req_per_s"] > 0
    assert data["record"]["recorder_hooks_us_per_check"] > 0
    assert "engine.decide" in data["profile"] and "req/s" in proc.stdout
