"""bench/configs.py: the issue-24 configurations (rh without the access log, rhb, hdb) and the
policies they run. The fast tests start nothing; the slow one runs them through the harness."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.configs import SETUPS, Options, policy_file
from bench.stack import Running
from extauthz.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", sorted(SETUPS))
def test_every_configuration_policy_loads(key: str) -> None:
    setup = SETUPS[key]
    assert policy_file(setup).is_file()
    load_policy([policy_file(setup)])  # raises PolicyError on a field the schema refuses


def test_batched_configurations_batch_request_rate() -> None:
    for key in ("rhb", "hdb"):
        limiters = {lim.name: lim for lim in load_policy([policy_file(SETUPS[key])]).limiters}
        assert limiters["user-rate"].consistency == "batched", key
    exact = {lim.name: lim for lim in load_policy([policy_file(SETUPS["rh"])]).limiters}
    assert exact["user-rate"].consistency == "exact"


def test_hdb_batches_the_fleet_limiter_too() -> None:
    limiters = {lim.name: lim for lim in load_policy([policy_file(SETUPS["hdb"])]).limiters}
    assert limiters["fleet"].consistency == "batched"
    exact = {lim.name: lim for lim in load_policy([policy_file(SETUPS["hd"])]).limiters}
    assert exact["fleet"].consistency == "exact"


@pytest.mark.parametrize(("key", "log"), [("rh", False), ("rhb", False), ("hdb", True), ("hd", True),
                                          ("r", True)])
def test_access_log_follows_the_policy_where_asked(key: str, log: bool, tmp_path: Path) -> None:
    # rh, rhb: no lease limiter, so no access log (extauthz envoy-config --access-log auto);
    # hdb holds leases (concurrent_requests); hd and r keep the config file's log as before
    assert Running(SETUPS[key], None, Options(), tmp_path).access_log() is log


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("h2load") is None
                    or shutil.which("redis-server") is None,
                    reason="wrk/h2load/redis-server not installed (scripts/install-system-deps.sh)")
def test_batched_configurations_run_and_count_store_calls(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    # a generous store deadline (below Envoy's 250 ms): on a busy machine the 5 ms one opens
    # the breaker, and checks that fail open make no store call (the counts would mean nothing)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--smoke", "--configs", "rh,rhb,hdb", "--deadline-ms", "200",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = {p["setup"]: p for p in json.loads(out.read_text())["phases"] if p["kind"] == "saturated"}
    assert set(phases) == {"rh", "rhb", "hdb"}
    for key, p in phases.items():
        # the counts, not the speed: on a busy machine some checks miss Envoy's own timeout
        assert p["ext_authz_ok"] > 0.5 * p["requests"], (key, p)
        assert p["store_script_calls"] is not None and p["store_script_calls"] > 0, (key, p)
    # a grant serves many requests of its key: fewer script calls per request than exact
    assert phases["rhb"]["store_script_calls"] < phases["rh"]["store_script_calls"], phases
    assert "script calls/req" in proc.stdout and "store fail-opens timeout" in proc.stdout
