"""``extauthz simulate``: generated traffic files whose outcome is known by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.commands.simulate.replay import Replay, ReplayedRequest
from extauthz.commands.simulate.traffic import BadLines, Request, TrafficFile, read_traffic
from extauthz.policy import load_policy
from extauthz.policy.classify import hash_identity
from testinfra.probes import write_lines

T0 = 1_732_420_000.0
REQUIRED = {"requests", "allowed", "refused", "by_limiter", "by_tier", "top_identities", "customers",
            "critical_refused", "refused_share", "customers_refused", "max_customer_refused_share"}


def policy_dir(tmp_path: Path, limiters: list[dict[str, Any]], name: str = "policy") -> Path:
    d = tmp_path / name
    d.mkdir()
    doc = {"version": 1, "identity": [{"header": "x-api-key"}], "limiters": limiters}
    (d / "policy.yaml").write_text(yaml.safe_dump(doc))
    return d


def line(t: float, key: str = "alice", method: str = "GET", path: str = "/v1/customers",
         duration: float | None = 0.0, tier: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"time": t, "method": method, "path": path, "host": "api.example.com",
                           "headers": {"x-api-key": key}, "duration": duration}
    if tier is not None:
        out["tier"] = tier
    return out


def simulate(tmp_path: Path, policy: Path, lines: list[dict[str, Any]], *extra: str,
             name: str = "traffic.jsonl") -> dict[str, Any]:
    traffic = write_lines(tmp_path / name, lines)
    out = tmp_path / "summary.json"
    assert main(["simulate", "--policies", str(policy), "--traffic", str(traffic),
                 "--json", str(out), *extra]) == 0
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


RATE = {"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500}


def test_token_bucket_seed_case(tmp_path: Path) -> None:
    """Rate 100, burst 500: 500 allowed, the 501st refused; one second later 100 more."""
    lines = [line(T0) for _ in range(501)] + [line(T0 + 1.0) for _ in range(101)]
    s = simulate(tmp_path, policy_dir(tmp_path, [RATE]), lines, name="bucket.jsonl.gz")
    assert set(s) == REQUIRED
    assert (s["requests"], s["allowed"], s["refused"]) == (602, 600, 2)
    assert s["by_limiter"] == {"user-rate": {"refused": 2, "identities": 1}}
    assert s["by_tier"] == {"get": {"requests": 602, "refused": 2}}
    assert s["top_identities"] == [{"identity": hash_identity("alice", "header:x-api-key"),
                                    "refused": 2, "requests": 602}]


def test_token_bucket_exact_positions(tmp_path: Path) -> None:
    policy = load_policy([policy_dir(tmp_path, [RATE])])
    seen: list[bool] = []
    reqs = [Request(T0, "GET", "/", headers={"x-api-key": "a"}) for _ in range(501)]
    reqs += [Request(T0 + 1.0, "GET", "/", headers={"x-api-key": "a"}) for _ in range(101)]
    Replay(policy, on_decision=lambda r: seen.append(r.candidate.allowed)).run(reqs)
    assert seen[:500] == [True] * 500 and seen[500] is False
    assert seen[501:601] == [True] * 100 and seen[601] is False


CONC = {"name": "user-concurrency", "type": "concurrent_requests", "limit": 20}


def test_concurrency_seed_case_overlapping(tmp_path: Path) -> None:
    """Limit 20: 21 overlapping requests, one refused."""
    lines = [line(T0 + i * 0.001, duration=1.0) for i in range(21)]
    s = simulate(tmp_path, policy_dir(tmp_path, [CONC]), lines)
    assert (s["requests"], s["allowed"], s["refused"]) == (21, 20, 1)
    assert s["by_limiter"]["user-concurrency"] == {"refused": 1, "identities": 1}


def test_concurrency_seed_case_sequential(tmp_path: Path) -> None:
    """Each request starts when the previous one ends: none refused, however many."""
    lines = [line(T0 + i * 1.0, duration=1.0) for i in range(100)]
    s = simulate(tmp_path, policy_dir(tmp_path, [CONC]), lines)
    assert (s["requests"], s["allowed"], s["refused"]) == (100, 100, 0)


def test_unknown_end_holds_the_lease_until_its_ttl(tmp_path: Path) -> None:
    """``duration: null`` (the access-log entry never came): held for lease_ttl (60 s)."""
    conc = {**CONC, "limit": 1}
    lines = [line(T0, duration=None), line(T0 + 59.0), line(T0 + 60.5)]
    s = simulate(tmp_path, policy_dir(tmp_path, [conc]), lines)
    assert (s["allowed"], s["refused"]) == (2, 1)


def test_fleet_reserve_holds_in_replay(tmp_path: Path) -> None:
    """Capacity 10, 20 % reserved: 8 non-critical in flight at most; critical always passes."""
    fleet = {"name": "fleet", "type": "fleet_usage", "capacity": 10, "reserved_for_critical": 0.2}
    lines = [line(T0 + i * 0.01, key=f"u{i}", duration=5.0) for i in range(12)]
    lines += [line(T0 + 0.5 + i * 0.01, key=f"c{i}", method="POST", duration=5.0, tier="critical")
              for i in range(6)]
    lines += [line(T0 + 6.0 + i * 0.01, key=f"v{i}", duration=5.0) for i in range(8)]
    s = simulate(tmp_path, policy_dir(tmp_path, [fleet]), lines)
    assert s["by_tier"]["get"] == {"requests": 20, "refused": 4}
    assert s["by_tier"]["critical"] == {"requests": 6, "refused": 0}
    assert s["by_limiter"]["fleet"] == {"refused": 4, "identities": 4}


WORKERS = {"name": "workers", "type": "worker_utilization",
           "signal": {"source": "inflight", "capacity": 10}, "sample_interval": 0.5,
           "good_below": 0.5, "bad_above": 0.6, "delay_before_shedding": 2, "time_to_shed_all": 6}


def shed_traffic() -> list[Request]:
    """10 slow critical requests keep the workers busy for 30 s; a steady mix of every
    tier runs for 80 s."""
    reqs = [Request(T0 + i * 0.001, "POST", "/v1/charges", headers={"x-api-key": f"slow{i}"},
                    duration=30.0, tier="critical") for i in range(10)]
    t = T0 + 0.1
    k = 0
    while t < T0 + 80:
        for tier, method in (("test", "GET"), ("get", "GET"), ("post", "POST"), ("critical", "POST")):
            k += 1
            reqs.append(Request(t, method, "/v1/x", headers={"x-api-key": f"{tier}{k}"}, tier=tier))
        t += 0.05
    return reqs


def test_worker_shedder_tier_order_in_replay(tmp_path: Path) -> None:
    policy = load_policy([policy_dir(tmp_path, [WORKERS])])
    first: dict[str, float] = {}
    last: dict[str, float] = {}

    def seen(r: ReplayedRequest) -> None:
        if not r.candidate.allowed:
            tier = r.context.tier.value
            first.setdefault(tier, r.request.time - T0)
            last[tier] = r.request.time - T0

    replay = Replay(policy, series=True, on_decision=seen).run(shed_traffic())
    assert "critical" not in first
    # shed in order test, then get, then post (delay 2 s, a third of the ramp every 2 s)
    assert 2.0 <= first["test"] < first["get"] < first["post"] <= 9.0
    # after the slow requests end (t=30) traffic comes back gradually: post first, test last
    assert 30.0 < last["post"] < last["get"] < last["test"] < 45.0
    levels = replay.candidate.series.levels["workers"]  # type: ignore[union-attr]
    assert max(lv for _, lv, _ in levels) == 1.0
    assert levels[-1][1] < 0  # back at rest


def test_worker_shedder_is_deterministic_with_a_seed(tmp_path: Path) -> None:
    policy = load_policy([policy_dir(tmp_path, [WORKERS])])
    runs = [Replay(policy, seed=7).run(shed_traffic()).summary() for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0]["refused"] > 0


def test_signal_file_drives_a_redis_signal_shedder(tmp_path: Path) -> None:
    workers = {**WORKERS, "signal": {"source": "redis"}}
    signal = tmp_path / "signal.jsonl"
    signal.write_text("".join(json.dumps({"time": T0 + t, "value": v}) + "\n"
                              for t, v in ((0, 0.1), (5, 1.0), (30, 0.0))))
    lines = [line(T0 + i * 0.1, key=f"k{i}", tier="test") for i in range(600)]
    s = simulate(tmp_path, policy_dir(tmp_path, [workers]), lines, "--signal", str(signal))
    assert s["by_tier"]["test"]["refused"] > 0
    without = simulate(tmp_path, tmp_path / "policy", lines, name="again.jsonl")
    assert without["refused"] == 0  # no signal: utilization 0, never sheds


def test_shadow_limiters_count_would_refuse(tmp_path: Path) -> None:
    shadow = {**RATE, "mode": "shadow"}
    lines = [line(T0) for _ in range(600)]
    s = simulate(tmp_path, policy_dir(tmp_path, [shadow]), lines)
    assert (s["allowed"], s["refused"]) == (600, 0)
    assert s["by_limiter"]["user-rate"] == {"refused": 100, "identities": 1}


def test_baseline_difference(tmp_path: Path) -> None:
    candidate = policy_dir(tmp_path, [{**RATE, "burst": 5, "rate": 1}], "candidate")
    baseline = policy_dir(tmp_path, [{**RATE, "burst": 10, "rate": 1}], "baseline")
    lines = [line(T0, key="alice") for _ in range(8)] + [line(T0, key="bob") for _ in range(3)]
    lines += [line(T0 + 0.5, key="carol") for _ in range(12)]
    s = simulate(tmp_path, candidate, lines, "--baseline", str(baseline))
    assert set(s) > REQUIRED and set(s) - REQUIRED == {"baseline", "difference"}
    assert (s["refused"], s["baseline"]["refused"]) == (3 + 7, 2)
    diff = s["difference"]
    assert diff["refused_by_candidate_only"] == 3 + 5
    assert diff["refused_by_baseline_only"] == 0
    assert diff["identities_refused_by_candidate_only"] == 2
    alice, carol = (hash_identity(k, "header:x-api-key") for k in ("alice", "carol"))
    assert diff["top_identities_hurt"] == [{"identity": carol, "requests": 5},
                                           {"identity": alice, "requests": 3}]


def test_recording_lines_replay_with_their_hashed_identity(tmp_path: Path) -> None:
    conc = {**CONC, "limit": 2}
    rec = [{"time": T0 + i * 0.01, "identity": "abc123", "identity_source": "header:x-api-key",
            "tier": "post", "method": "POST", "path": "/v1/x", "host": "h", "decision": "allowed",
            "limiter": None, "duration": 1.0} for i in range(3)]
    s = simulate(tmp_path, policy_dir(tmp_path, [conc]), rec, name="rec.jsonl.gz")
    assert s["by_tier"] == {"post": {"requests": 3, "refused": 1}}
    assert s["top_identities"] == [{"identity": "abc123", "refused": 1, "requests": 3}]


def test_envoy_format_fields(tmp_path: Path) -> None:
    """duration_ms, '-' for absent values, a query string in the path."""
    conc = {**CONC, "limit": 1}
    lines = [{"time": str(T0), "method": "GET", "path": "/v1/x?a=1", "host": "h",
              "headers": {"x-api-key": "k", "authorization": "-"}, "duration_ms": 1500, "tier": "-"},
             {"time": str(T0 + 1.0), "method": "GET", "path": "/v1/x", "host": "h",
              "headers": {"x-api-key": "k", "authorization": None}, "duration_ms": 10, "tier": None}]
    s = simulate(tmp_path, policy_dir(tmp_path, [conc]), lines)
    assert (s["allowed"], s["refused"]) == (1, 1)


def test_out_of_order_within_the_window_is_sorted(tmp_path: Path) -> None:
    """Logs are written when requests end: start times arrive out of order."""
    conc = {**CONC, "limit": 1}
    lines = [line(T0 + 2.0, duration=0.1), line(T0, duration=1.0), line(T0 + 0.5, duration=0.1)]
    s = simulate(tmp_path, policy_dir(tmp_path, [conc]), lines)
    # sorted: T0 (held to T0+1), T0+0.5 refused, T0+2 allowed
    assert (s["allowed"], s["refused"]) == (2, 1)


BAD = [line(T0), "not json at all", {"method": "GET", "path": "/"}, line(T0 + 300.0), line(T0 + 1.0),
       line(T0 + 301.0)]


def write_bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in BAD))
    return path


@pytest.mark.parametrize(("upto", "message"), [
    (2, "bad.jsonl:2: not JSON"),
    (3, "bad.jsonl:3: missing 'time'"),
])
def test_bad_lines_are_errors_naming_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   upto: int, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    keep = [BAD[0], BAD[upto - 1]]
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in keep))
    policy = policy_dir(tmp_path, [RATE])
    message = message.replace(f":{upto}:", ":2:")
    assert main(["simulate", "--policies", str(policy), "--traffic", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_out_of_order_beyond_the_window_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "late.jsonl", [line(T0), line(T0 + 300.0), line(T0 + 1.0)])
    policy = policy_dir(tmp_path, [RATE])
    assert main(["simulate", "--policies", str(policy), "--traffic", str(path),
                 "--reorder-window", "10"]) == 2
    err = capsys.readouterr().err
    assert "late.jsonl:3: time" in err and "--reorder-window 10 s" in err


def test_bad_lines_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_bad(tmp_path)
    policy = policy_dir(tmp_path, [RATE])
    out = tmp_path / "s.json"
    assert main(["simulate", "--policies", str(policy), "--traffic", str(path), "--json", str(out),
                 "--skip-bad-lines", "--reorder-window", "10"]) == 0
    s = json.loads(out.read_text())
    assert s["requests"] == 3  # lines 1, 4 and 6
    err = capsys.readouterr().err
    assert "skipped 3 bad lines (1 not_json, 1 missing_field, 1 out_of_order)" in err
    assert "bad.jsonl:2: not JSON" in err


def test_files_are_merged_in_time_order(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [line(T0 + i, key="a") for i in range(0, 10, 2)])
    b = write_lines(tmp_path / "b.jsonl.gz", [line(T0 + i, key="b") for i in range(1, 10, 2)])
    times = [r.time - T0 for r in read_traffic([TrafficFile(a), TrafficFile(b)], bad=BadLines())]
    assert times == [float(i) for i in range(10)]


def test_report_writes_markdown_and_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    policy = policy_dir(tmp_path, [RATE, WORKERS])
    baseline = policy_dir(tmp_path, [{**RATE, "burst": 50}], "baseline")
    traffic = write_lines(tmp_path / "t.jsonl", [line(T0 + i * 0.001, key=f"k{i % 3}") for i in range(3000)])
    report = tmp_path / "report"
    assert main(["simulate", "--policies", str(policy), "--traffic", str(traffic),
                 "--baseline", str(baseline), "--report", str(report)]) == 0
    md = (report / "report.md").read_text()
    assert "## Who the candidate would hurt" in md
    for png in ("refusals_by_limiter.png", "refusals_by_tier.png", "shedder_level.png", "top_identities.png"):
        data = (report / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({png})" in md


def test_plans_replay_from_recordings_and_from_headers(tmp_path: Path) -> None:
    """A recording keeps the server's plan; plain lines get theirs from the candidate's rules."""
    d = tmp_path / "plans"
    d.mkdir()
    (d / "p.yaml").write_text(yaml.safe_dump({
        "version": 1, "identity": [{"header": "x-api-key"}],
        "plan": {"from": [{"header": "x-plan"}], "default": "free"},
        "limiters": [{**RATE, "rate": 1, "burst": 10, "plans": {"free": {"burst": 2}, "pro": {"burst": 4}}}]}))
    rec = [{"time": T0, "identity": ident, "tier": "get", "method": "GET", "path": "/", "plan": plan,
            "decision": "allowed", "duration": 0.0}
           for ident, plan in (("aa", "free"), ("bb", "pro"), ("cc", "enterprise"), ("dd", None))
           for _ in range(5)]
    s = simulate(tmp_path, d, rec, name="rec.jsonl")
    # free: 2 of 5 pass; pro: 4 of 5; a plan the candidate does not know, or none: the default (free)
    assert {row["identity"]: row["refused"] for row in s["top_identities"]} == {"aa": 3, "bb": 1, "cc": 3,
                                                                              "dd": 3}
    plain = [{**line(T0, key="k1"), "headers": {"x-api-key": "k1", "x-plan": "pro"}} for _ in range(5)]
    plain += [{**line(T0, key="k2"), "headers": {"x-api-key": "k2"}} for _ in range(5)]
    s = simulate(tmp_path, d, plain, name="plain.jsonl")
    assert s["refused"] == 1 + 3  # k1 on pro (burst 4), k2 on the default plan (free, burst 2)


def test_keyed_limiters_and_a_quota_across_a_month_boundary(tmp_path: Path) -> None:
    """A per-IP limit beside a per-key one, a skipped key, and a monthly quota whose window
    ends at 2026-02-01T00:00:00Z on the virtual clock."""
    end_of_january = 1_769_904_000.0  # 2026-02-01T00:00:00Z
    policy = policy_dir(tmp_path, [
        {"name": "per-ip", "type": "request_rate", "rate": 0.001, "burst": 3, "key": [{"source_ip": True}]},
        {"name": "per-org", "type": "request_rate", "rate": 0.001, "burst": 100, "key": [{"header": "x-org"}]},
        {"name": "monthly", "type": "quota", "limit": 2, "period": "month", "key": [{"identity": True}]},
    ])
    lines = []
    for i, key in enumerate(["a", "b", "c", "d"]):  # one IP, four API keys: the 4th is over per-ip
        lines.append({**line(end_of_january - 100 + i, key), "source_ip": "10.0.0.1"})
    lines += [{**line(end_of_january - 50 + i, "e"), "source_ip": f"10.0.1.{i}"} for i in range(3)]
    lines += [{**line(end_of_january + 1, "e"), "source_ip": "10.0.2.1"}]  # February: a new month
    s = simulate(tmp_path, policy, lines)
    assert s["by_limiter"]["per-ip"] == {"refused": 1, "identities": 1, "skipped_key_missing": 0}
    # no x-org on any request: skipped every time, never refusing
    assert s["by_limiter"]["per-org"] == {"refused": 0, "identities": 0, "skipped_key_missing": 8}
    # e's third request in January is over the quota; February starts again
    assert s["by_limiter"]["monthly"] == {"refused": 1, "identities": 1}
    assert (s["requests"], s["allowed"], s["refused"]) == (8, 6, 2)
