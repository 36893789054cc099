"""bench/fleet_cluster.py: fleet checks on a real 3-master Redis Cluster, exact and (once
fleet_usage accepts it) batched. No timing assertions: the figures are there and consistent."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fleet_cluster import MODES, policy_text
from extauthz.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]


def test_modes_follow_what_the_schema_accepts(tmp_path: Path) -> None:
    for mode in MODES:
        path = tmp_path / f"{mode}.yaml"
        path.write_text(policy_text(mode))
        [fleet] = load_policy([path]).limiters
        assert fleet.type == "fleet_usage" and fleet.consistency == mode


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None and shutil.which("redis-cli") is None,
                    reason="redis-server not installed (scripts/install-system-deps.sh)")
def test_quick_run_on_a_three_master_cluster(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, "-m", "bench.fleet_cluster", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["masters"] == 3 and set(data["modes"]) == set(MODES)
    for mode, fig in data["modes"].items():
        assert fig["checks_per_s"] > 0 and fig["evalsha_per_check"] > 0, (mode, fig)
        assert fig["fail_open"] == 0, (mode, fig)
    # one master holds {fleet}: it alone answers the fleet scripts
    assert proc.stdout.count("| yes |") == 1
