"""The benchmark harness runs end to end (``--smoke``): real Envoy, the server process, wrk and
h2load, for (a) Envoy alone, (b) the no-op server, (c) all limiters on the embedded store and
(h) the no-op server on Envoy's HTTP authorization protocol, and (r) one request_rate limiter on
Redis, whose Redis commands and store round trips per request are counted.

Asserts only that figures were produced and that ext_authz was really consulted: no timing
assertions (the machine's speed is not under test)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def smoke_run(tmp_path: Path, configs: str) -> dict[str, Any]:
    """``bench.harness --smoke`` for ``configs``: its JSON result."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--smoke", "--configs", configs, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("h2load") is None,
                    reason="wrk/h2load not installed (scripts/install-system-deps.sh)")
def test_smoke_run_produces_figures(tmp_path: Path) -> None:
    result = smoke_run(tmp_path, "a,b,c,h,r")
    phases = result["phases"]
    assert {(p["setup"], p["kind"]) for p in phases} == {
        (s, k) for s in "abchr" for k in ("saturated", "latency")}
    for p in phases:
        assert p["requests"] > 0, p
        assert p["rps"] > 0, p
        if p["kind"] == "latency":
            assert p["p50_ms"] > 0 and p["p99_ms"] >= p["p50_ms"] and p["p999_ms"] >= p["p99_ms"], p
        if p["setup"] in ("b", "c", "h"):
            # ext_authz was consulted for (nearly) every request and never failed open in Envoy
            assert p["ext_authz_ok"] >= 0.99 * p["requests"], p
            assert p["ext_authz_failure_mode_allowed"] == 0, p
            assert p["server_cpu_us"] > 0, p
        elif p["setup"] == "a":
            assert p["ext_authz_ok"] is None
        if p["setup"] == "r":
            # The counts, not the speed (on a busy machine a Redis-backed check may miss
            # Envoy's timeout): Redis's commandstats (the script and the commands inside
            # it) and the server's own round-trip counter (never more than one per request).
            assert p["ext_authz_ok"] > 0 and p["server_cpu_us"] > 0, p
            assert p["redis_commands"]["evalsha"] > 0 and p["redis_commands"]["get"] > 0, p
            # (per request the load tool counted: checks in flight at the snapshots' edges
            # are the server's and not the tool's, so a run where every check reached Redis
            # alone, none skipped by a breaker, may read a hair over 1: 1.0005 seen)
            assert 0 < p["store_round_trips"] <= 1.01, p
        else:
            assert p["redis_commands"] == {} and p["store_round_trips"] is None, p
    rows = {r["key"]: r for r in result["summary"]["rows"]}
    assert rows["r"]["redis_calls"]["saturated"]["commands"] > 0
    assert rows["b"]["consulted"] and rows["c"]["consulted"] and rows["h"]["consulted"]
    assert rows["a"]["rps"] > 0


@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("redis-server") is None,
                    reason="wrk/redis-server not installed (scripts/install-system-deps.sh)")
def test_flood_configurations_produce_figures(tmp_path: Path) -> None:
    """(f) the flood and (fc) the same load without the flooding key: the flooding key is
    refused (Envoy counts denials), every other request is a full Check, and the summary
    carries the two flood ratios."""
    result = smoke_run(tmp_path, "f,fc")
    phases = {(p["setup"], p["kind"]): p for p in result["phases"]}
    assert set(phases) == {(s, k) for s in ("f", "fc") for k in ("saturated", "latency")}
    for (setup, kind), p in phases.items():
        # (not asserted: Envoy's failure_mode_allowed, Checks past Envoy's timeout on a
        # loaded machine: a speed, shown in the report)
        assert p["requests"] > 0, p
        if setup == "f":
            assert p["ext_authz_denied"] > 0 and p["flood_factor"] > 1, p  # refused, over its rate
        else:
            # nothing refused but what a starved server's shedders refused (docs/limiters.md,
            # "A starved server": a loaded machine starves the server under wrk)
            assert p["ext_authz_denied"] <= p["overload_checks"], p
        checked = p["ext_authz_ok"] + p["ext_authz_denied"] + p["ext_authz_failure_mode_allowed"]
        assert checked >= 0.99 * p["requests"], p  # every request went through ext_authz
        if kind == "latency":
            assert p["flood_rps"] > 0 and p["p99_ms"] >= p["p50_ms"] > 0, p
    assert {"f/fc", "p99 f/fc"} <= set(result["summary"]["ratios"])
    assert any(t["target"].startswith("Flood: well-behaved") for t in result["targets"])
