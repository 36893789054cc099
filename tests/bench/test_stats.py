"""The harness's statistics on made-up figures (no load run): which ratios a run reports and
how they are taken (per round, then the median), and the percentile rule."""

from __future__ import annotations

import pytest

from bench.configs import SETUPS
from bench.stats import Phase, percentile, summarize


def phases(rps: dict[str, list[float]], p99: dict[str, list[float]]) -> list[Phase]:
    out = []
    for key, values in rps.items():
        for r, v in enumerate(values):
            out.append(Phase(key, "saturated", r, requests=int(v), rps=v))
            out.append(Phase(key, "latency", r, p50_ms=1.0, p99_ms=p99[key][r], p999_ms=p99[key][r]))
    return out


def test_ratios_are_medians_of_per_round_ratios() -> None:
    rps = {"a": [1000.0, 2000.0, 1000.0], "b": [100.0, 100.0, 300.0], "d": [80.0, 50.0, 150.0]}
    p99 = {"a": [1.0, 1.0, 1.0], "b": [3.0, 5.0, 3.0], "d": [4.0, 9.0, 5.0]}
    summary = summarize([SETUPS[k] for k in ("a", "b", "d")], phases(rps, p99))
    ratios = summary["ratios"]
    assert list(ratios) == ["b/a", "d/a", "d/b", "p99 added d/b"]
    assert ratios["d/b"]["rounds"] == [0.8, 0.5, 0.5]
    assert ratios["d/b"]["median"] == pytest.approx(0.5)
    assert ratios["b/a"]["rounds"] == [0.1, 0.05, 0.3]
    assert ratios["p99 added d/b"]["rounds"] == [1.5, 2.0, 2.0]
    rows = {row["key"]: row for row in summary["rows"]}
    assert rows["d"]["rps"] == 80.0 and rows["d"]["rps_all"] == [80, 50, 150]
    assert rows["a"]["consulted"] is None  # no ext_authz in (a)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 99.9) == 100.0
    assert percentile([], 50) != percentile([], 50)  # nan


def test_flood_ratios_and_targets() -> None:
    """(f) against (c) on throughput, (f) against (fc) on the well-behaved keys' p99."""
    from bench.stats import targets

    rps = {"c": [1000.0, 1000.0, 1000.0], "f": [1200.0, 900.0, 1100.0], "fc": [1000.0, 1000.0, 1000.0]}
    p99 = {"c": [5.0, 5.0, 5.0], "f": [6.0, 7.0, 5.0], "fc": [5.0, 5.0, 5.0]}
    summary = summarize([SETUPS[k] for k in ("c", "f", "fc")], phases(rps, p99))
    ratios = summary["ratios"]
    assert ratios["f/c"]["rounds"] == [1.2, 0.9, 1.1]
    assert ratios["p99 f/fc"]["rounds"] == [1.2, 1.4, 1.0]
    found = {t["target"]: t for t in targets(summary, limits=None, outages=[], deadline_ms=5.0)}
    assert found["Flood: (f) throughput / (c)"]["value"] == pytest.approx(1.1)
    assert found["Flood: (f) throughput / (c)"]["met"]
    p99_target = found["Flood: well-behaved keys' p99 at 1,000 req/s, (f) / (fc)"]
    assert p99_target["value"] == pytest.approx(1.2) and p99_target["met"] and not p99_target["higher"]


def test_redis_calls_per_request_are_medians_by_command_and_reported() -> None:
    from bench.report import redis_calls_table

    out = []
    for r, (evalsha, trips) in enumerate(((1.0, 0.5), (1.0, 0.25), (1.0, 0.75))):
        out.append(Phase("r", "saturated", r, requests=100, rps=100.0,
                         redis_commands={"evalsha": evalsha, "time": 1.0, "get": 1.0, "set": 1.0 - r / 4},
                         store_round_trips=trips, store_script_calls=evalsha))
        out.append(Phase("r", "latency", r, p50_ms=1.0, p99_ms=2.0, p999_ms=2.0))
    row = summarize([SETUPS["r"]], out)["rows"][0]
    sat = row["redis_calls"]["saturated"]
    assert sat["commands"] == 3.75  # median of 4, 3.75, 3.5
    assert list(sat["by_command"].items()) == [("evalsha", 1.0), ("get", 1.0), ("time", 1.0), ("set", 0.75)]
    assert (sat["round_trips"], sat["script_calls"]) == (0.5, 1.0)
    assert row["redis_calls"]["latency"]["commands"] is None  # not measured: no line for it
    table = redis_calls_table([row])
    assert "| r | saturated | 3.75 | evalsha 1.00, get 1.00, time 1.00, set 0.75 | 0.500 | 1.000 |" in table
    assert not any("| r | latency |" in line for line in table)
    assert summarize([SETUPS["c"]], [])["rows"][0]["redis_calls"] is None  # no Redis in (c)


def test_quota_rows_read_envoy_cpu_and_the_peer_against_envoy_alone() -> None:
    """Issue 33: (q)'s Envoy CPU per request and throughput over (a)'s, per round, and the Go
    peer's requests per second read as its share of Envoy alone (PEER_OVER_ENVOY_ALONE)."""
    from bench.stats import PEER_OVER_ENVOY_ALONE, targets

    out = []
    for r, (a, q, ea, eq) in enumerate([(20000.0, 12000.0, 50.0, 60.0), (18000.0, 9000.0, 50.0, 80.0),
                                        (20000.0, 13000.0, 40.0, 50.0)]):
        out.append(Phase("a", "saturated", r, requests=int(a), rps=a, envoy_cpu_us=ea))
        out.append(Phase("q", "saturated", r, requests=int(q), rps=q, envoy_cpu_us=eq, server_cpu_us=3.0,
                         refused=0, quota_reports=2, quota_entries=2000, quota_buckets=1000,
                         server_cpu_us_per_entry=18.0, quota_allowed=int(q), quota_denied=0,
                         quota_overadmission=0, quota_ledger_failures=0))
    summary = summarize([SETUPS["a"], SETUPS["q"]], out)
    ratios = summary["ratios"]
    assert ratios["q/a"]["rounds"] == [0.6, 0.5, 0.65]
    assert ratios["envoy cpu q/a"]["rounds"] == [1.2, 1.6, 1.25]
    row = {r["key"]: r for r in summary["rows"]}["q"]
    assert row["quota"]["entries"] == 2000 and row["quota"]["refused"] == 0
    assert row["cores"]["server"] is not None  # the server runs (the quota stream) without ext_authz
    found = {t["target"]: t for t in targets(summary, limits=None, outages=[], deadline_ms=5.0)}
    assert found["(q) Envoy CPU per request / (a)"]["value"] == pytest.approx(1.25)
    assert found["(q) Envoy CPU per request / (a)"]["met"]
    assert found["(q) throughput / (a)"]["value"] == pytest.approx(0.6) and found["(q) throughput / (a)"]["met"]
    peer = found["(q) throughput / the Go peer's (as shares of Envoy alone)"]
    assert peer["value"] == pytest.approx(0.6 / PEER_OVER_ENVOY_ALONE, abs=1e-3) and peer["met"]
    assert found["(q) quota over-admission"]["value"] == 0 and found["(q) quota over-admission"]["met"]


def test_the_gateway_doors_targets_read_their_cpu_and_throughput_ratios() -> None:
    """Issue 31's (b-h2, r-h2, d-h2) and issue 32's (rl) targets, each from its round ratios."""
    from bench.stats import targets

    cpu = {"h": [100.0] * 3, "b-h2": [120.0, 140.0, 125.0], "rh": [200.0] * 3, "r-h2": [250.0, 230.0, 260.0],
           "d-h2": [400.0] * 3, "rl": [280.0, 300.0, 240.0]}
    rps = {"h": [9000.0] * 3, "b-h2": [5000.0] * 3, "rh": [7000.0] * 3, "r-h2": [4000.0, 3000.0, 4000.0],
           "d-h2": [2500.0, 3500.0, 2500.0], "rl": [3800.0] * 3}
    out = []
    for key, values in rps.items():
        for r, v in enumerate(values):
            out.append(Phase(key, "saturated", r, requests=int(v), rps=v, server_cpu_us=cpu[key][r]))
            out.append(Phase(key, "latency", r, p50_ms=1.0, p99_ms=2.0, p999_ms=2.0))
    summary = summarize([SETUPS[k] for k in rps], out)
    found = {t["target"]: t for t in targets(summary, limits=None, outages=[], deadline_ms=5.0)}
    rl = found["(rl) server CPU per ShouldRateLimit / (r-h2)'s per Check, issue 32"]
    assert rl["value"] == pytest.approx(280 / 250) and rl["met"] and not rl["higher"]  # [1.12, 1.30, 0.92]
    b = found["(b-h2) server CPU per check / (h), issue 31"]
    assert b["value"] == pytest.approx(1.25) and b["met"]
    assert not found["(r-h2) server CPU per check / (rh), issue 31"]["met"]  # 1.25 > 1.2
    assert found["(r-h2) throughput / (b-h2), issue 31"]["value"] == pytest.approx(0.8)
    d = found["(d-h2) throughput / (b-h2), issue 31"]
    assert d["value"] == pytest.approx(0.5) and not d["met"]


def test_a_full_run_without_the_limits_library_stops_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The limits comparison runs last: without ``limits`` the harness says so at once (a full
    run once stopped there after 25 minutes), and --no-limits runs without it."""
    import importlib.util

    from bench import harness

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "limits" else real(name, *a))
    started: list[object] = []
    monkeypatch.setattr(harness.Harness, "run", lambda self: started.append(self))
    with pytest.raises(SystemExit, match="needs the `limits` library"):
        harness.main(["--only", "r", "--rounds", "1", "--no-docs"])
    assert started == []
    harness.main(["--only", "r", "--rounds", "1", "--no-docs", "--no-limits"])
    assert len(started) == 1
