"""bench/configs.py: the issue-24 configurations (rh without the access log, rhb, hdb) and the
policies they run. The fast tests start nothing; the slow one runs them through the harness."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


@pytest.mark.parametrize("key", ["q", "q-mem"])
def test_quota_rows_run_the_quota_filter_without_ext_authz(key: str, tmp_path: Path) -> None:
    """Issue 33: (q) and (q-mem) are (a) plus Envoy's rate limit quota filter streaming to the
    server's gRPC port (envoy-config --rlqs); no Check per request, so no ext_authz filter."""
    setup = SETUPS[key]
    assert setup.server and not setup.ext_authz
    config = Running(setup, None, Options(), tmp_path)._config(4321)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert "extauthz.rlqs.user-rate" in names
    assert not any("ext_authz" in n for n in names), names
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert "4321" in str(clusters["extauthz"])  # the quota stream's cluster: the server's gRPC port


def test_the_rate_limit_row_is_the_generators_with_an_upstream_answering_itself(tmp_path: Path) -> None:
    """(rl): ``envoy-config --protocol ratelimit``'s bootstrap with its ``direct_upstream``
    option (the filter skips a route that answers directly, so the upstream cluster points at
    a second listener of the same Envoy answering 200), not a listener appended to its YAML;
    a real Envoy takes it."""
    from testinfra.envoy_configs import validate

    config = Running(SETUPS["rl"], None, Options(), tmp_path)._config(4321)
    ingress, upstream = config["static_resources"]["listeners"]
    manager = ingress["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.ratelimit", "envoy.filters.http.router"]
    assert manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"] == {"cluster": "upstream"}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    endpoint = clusters["upstream"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert upstream["address"] == endpoint  # the upstream cluster is the answering listener
    answer = upstream["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
    assert answer["routes"][0]["direct_response"] == {"status": 200, "body": {"inline_string": "ok"}}
    assert "4321" in str(clusters["extauthz"])
    validate(yaml.safe_dump(config, sort_keys=False))


def test_quota_counters_flag_refusals_and_a_reconnected_stream() -> None:
    """bench/stack.py fill_quota on made-up snapshots: CPU per report entry, and a run whose
    Envoy refused requests or whose stream ended (its new stream waits for the old holds) is
    flagged not comparable."""
    from bench.stack import fill_quota
    from bench.stats import Phase

    def snap(cpu: float, reports: int, closed: int = 0, allowed: int = 0) -> dict[str, object]:
        return {"server_cpu": {1: cpu}, "quota": {
            "reports": reports, "streams": 1, "closed": closed, "bound_refused": closed, "buckets": 1000,
            "overadmission": 0, "ledger_failures": 0, "allowed": allowed, "denied": 0}}

    clean = Phase("q", "saturated", 0, requests=100_000, seconds=10.0)
    fill_quota(clean, snap(1.0, 1000), snap(1.04, 1002, allowed=100_000), SETUPS["q"])
    assert clean.quota_reports == 2 and clean.quota_entries == 2000
    assert clean.server_cpu_us_per_entry == pytest.approx(20.0)
    assert clean.quota_allowed == 100_000 and clean.problems == []

    refused = Phase("q", "saturated", 0, requests=100_000, seconds=10.0, non_2xx=500)
    fill_quota(refused, snap(1.0, 1000), snap(1.04, 1002, closed=1), SETUPS["q"])
    assert refused.refused == 500
    assert any("refused 500 of 100000" in p for p in refused.problems), refused.problems
    assert any("1 quota stream(s) closed" in p for p in refused.problems), refused.problems


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("h2load") is None
                    or shutil.which("redis-server") is None,
                    reason="wrk/h2load/redis-server not installed (scripts/install-system-deps.sh)")
def test_quota_row_runs_through_real_envoy(tmp_path: Path) -> None:
    """(q) through the harness: Envoy's quota filter decides every request after the warm-up
    (nothing refused in the measured run, no stream closed), the server holds one bucket per
    rotating key, and Envoy's CPU per request is read beside (a)'s."""
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--smoke", "--configs", "a,q", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    q = {p["kind"]: p for p in run["phases"] if p["setup"] == "q"}
    sat = q["saturated"]
    assert sat["requests"] > 0 and sat["refused"] == 0, sat
    assert sat["quota_buckets"] == 1000, sat  # one bucket per rotating API key
    assert not any("closed" in x for x in sat["problems"]), sat["problems"]
    assert sat["envoy_cpu_us"] and sat["server_cpu_us"] is not None, sat
    assert q["latency"]["quota_buckets"] == 1, q["latency"]  # h2load: one key
    assert "envoy cpu q/a" in run["summary"]["ratios"]
