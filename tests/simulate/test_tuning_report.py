"""``extauthz simulate --report``, through the console script: the per-customer table, names
from ``--identities``, critical refusals flagged first, the peak load removed, ``--fail-on``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from extauthz.policy.classify import hash_identity
from testinfra.probes import write_lines

from ..conftest import ROOT
from .test_replay import RATE, T0, line, policy_dir

EXTAUTHZ = str(Path(sys.executable).with_name("extauthz"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXTAUTHZ, "simulate", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def case(tmp_path: Path) -> dict[str, str]:
    """Candidate burst 5 (rate 1/s), baseline burst 50: over 10 s alice sends 40 GETs (every
    0.25 s), payer 20 critical POSTs (every 0.5 s), bob 4 GETs. The candidate lets through
    5 + the seconds elapsed: alice 5 + 9 of 40 (26 refused), payer 5 + 9 of 20 (6 refused),
    bob all 4; the baseline refuses nobody."""
    candidate = policy_dir(tmp_path, [{**RATE, "rate": 1, "burst": 5}], "candidate")
    baseline = policy_dir(tmp_path, [{**RATE, "rate": 1, "burst": 50}], "baseline")
    lines = [line(T0 + i * 0.25, key="alice") for i in range(40)]
    lines += [line(T0 + i * 0.5, key="payer", method="POST", tier="critical") for i in range(20)]
    lines += [line(T0 + i * 2.5, key="bob") for i in range(4)]
    lines.sort(key=lambda x: x["time"])
    traffic = write_lines(tmp_path / "t.jsonl", lines)
    names = tmp_path / "names.txt"
    names.write_text("# our customers\nalice\talice\npayer\tpayer\n")
    return {"candidate": str(candidate), "baseline": str(baseline), "traffic": str(traffic),
            "names": str(names), "out": str(tmp_path / "report"), "json": str(tmp_path / "s.json")}


def test_the_report_answers_who_and_flags_critical_first(case: dict[str, str]) -> None:
    pytest.importorskip("matplotlib")
    out = run("--policies", case["candidate"], "--baseline", case["baseline"], "--traffic", case["traffic"],
              "--report", case["out"], "--json", case["json"], "--identities", case["names"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CRITICAL TRAFFIC REFUSED: the candidate refuses 6 critical requests")
    s: dict[str, Any] = json.loads(Path(case["json"]).read_text())
    assert (s["refused"], s["critical_refused"], s["customers_refused"]) == (32, 6, 2)
    assert s["refused_share"] == pytest.approx(32 / 64)
    assert s["max_customer_refused_share"] == pytest.approx(26 / 40)
    by_name = {row.get("label", row["identity"]): row for row in s["customers"]}
    assert list(by_name) == ["alice", "payer"]  # the largest change first; bob is never refused
    alice = by_name["alice"]
    assert alice["share_of_traffic"] == pytest.approx(40 / 64)
    assert alice["candidate"] == {"refused": 26, "by_limiter": {"user-rate": 26}, "by_tier": {"get": 26}}
    assert alice["baseline"] == {"refused": 0, "by_limiter": {}, "by_tier": {}}
    assert by_name["payer"]["candidate"]["by_tier"] == {"critical": 6} and by_name["payer"]["change"] == 6

    md = (Path(case["out"]) / "report.md").read_text()
    assert md.splitlines()[2] == ("> **Critical traffic refused: the candidate refuses 6 critical "
                                  "requests** (the baseline: 0).")
    assert "| `alice` | 62.5% | 40 | 0 | 26 | +26 | user-rate 26 | get 26 | - | - |" in md
    assert "| `payer` | 31.2% | 20 | 0 | 6 | +6 | user-rate 6 | critical 6 | - | - |" in md
    assert "| critical_refused | 6 | 0 |" in md
    assert ("* `alice`: user-rate would admit all 40 of its requests with burst 31 (at rate 1/s), or rate "
            "3.59/s (at burst 5)") in md
    assert "The candidate removes at most **" in md
    assert "## Request by request" in md and "its own limiter state" in md
    for png in ("refusals_by_limiter.png", "refusals_by_tier.png", "top_identities.png"):
        assert (Path(case["out"]) / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_names_are_written_only_when_given(case: dict[str, str]) -> None:
    pytest.importorskip("matplotlib")
    out = run("--policies", case["candidate"], "--baseline", case["baseline"], "--traffic", case["traffic"],
              "--report", case["out"], "--json", case["json"])
    assert out.returncode == 0, out.stderr
    md = (Path(case["out"]) / "report.md").read_text()
    text = Path(case["json"]).read_text()
    for written in (md, text):
        assert "alice" not in written and "payer" not in written and '"label"' not in written
    assert f"| `{hash_identity('alice', 'header:x-api-key')}` | 62.5% |" in md


def test_fail_on_exits_3_and_says_which_condition_held(case: dict[str, str]) -> None:
    common = ("--policies", case["candidate"], "--traffic", case["traffic"])
    out = run(*common, "--fail-on", "critical_refused > 0", "--fail-on", "refused_share >= 0.99")
    assert out.returncode == 3
    assert "extauthz simulate: --fail-on 'critical_refused > 0' holds: critical_refused = 6" in out.stderr
    assert "refused_share >= 0.99" not in out.stderr
    out = run(*common, "--fail-on", "max_customer_refused_share<0.5", "--fail-on", "customers_refused == 2")
    assert out.returncode == 3
    assert "--fail-on 'customers_refused == 2' holds: customers_refused = 2" in out.stderr
    assert "max_customer_refused_share" not in out.stderr
    assert run(*common, "--fail-on", "refused > 32", "--fail-on", "refused <= 31").returncode == 0


@pytest.mark.parametrize(("expr", "says"), [
    ("critical > 0", "unknown figure 'critical'"),
    ("refused >> 1", "expected [customer:HASH_OR_NAME] FIGURE OP NUMBER"),
    ("refused > many", "expected [customer:HASH_OR_NAME] FIGURE OP NUMBER"),
    ("refused > 1e999", "not a finite number"),
    ("refused", "expected [customer:HASH_OR_NAME] FIGURE OP NUMBER"),
    ("customer:alice critical_refused > 0", "unknown figure 'critical_refused' for a customer"),
    ("customers_refused > 5%", "a % compares a share"),
    ("refused > baseline - 1", "expected [customer:HASH_OR_NAME] FIGURE OP NUMBER"),
])
def test_a_bad_fail_on_expression_is_a_usage_error(case: dict[str, str], expr: str, says: str) -> None:
    out = run("--policies", case["candidate"], "--traffic", case["traffic"], "--fail-on", expr)
    assert out.returncode == 2
    assert "argument --fail-on" in out.stderr and says in out.stderr, out.stderr


def test_json_into_a_missing_directory_makes_it_and_a_file_in_the_way_is_refused(
        case: dict[str, str], tmp_path: Path) -> None:
    out = run("--policies", case["candidate"], "--traffic", case["traffic"], "--json",
              str(tmp_path / "new" / "dir" / "s.json"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "new" / "dir" / "s.json").read_text())["requests"] == 64
    (tmp_path / "afile").write_text("")
    out = run("--policies", case["candidate"], "--traffic", case["traffic"], "--json",
              str(tmp_path / "afile" / "s.json"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("extauthz simulate: error: cannot make the output directory:"), out.stderr


def test_the_tuning_docs_worked_example_runs_as_written_in_a_fresh_directory(tmp_path: Path) -> None:
    """docs/tuning.md's "A real example" command, copied from the doc and run by a shell in an
    empty directory holding only its inputs: ``--json report/summary.json --report report/``
    makes report/ (it stopped with "no directory report", exit 2)."""
    pytest.importorskip("matplotlib")
    doc = (ROOT / "docs" / "tuning.md").read_text()
    block = next(m.group(1) for m in re.finditer(r"```sh\n(.*?)```", doc, re.S)
                 if "--json report/summary.json" in m.group(1))
    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    (tmp_path / "candidate").mkdir()
    shutil.copy(ROOT / "docs" / "pictures" / "tuning" / "candidate-api.yaml", tmp_path / "candidate" / "api.yaml")
    shutil.copy(ROOT / "docs" / "pictures" / "tuning" / "customers.txt", tmp_path / "customers.txt")
    (tmp_path / "record").mkdir()
    burst = [line(T0 + i * 0.01, key="sk_live_batchjob") for i in range(300)]  # past the candidate's burst 100
    write_lines(tmp_path / "record" / "record-1.jsonl.gz", [*burst, line(T0 + 5, key="sk_live_user1")])
    env = {**os.environ, "PATH": f"{Path(EXTAUTHZ).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    s = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert s["requests"] == 301 and (tmp_path / "report" / "report.md").is_file()
    assert [c.get("label") for c in s["customers"]][:1] == ["batch-job"]
    assert "sk_live" not in out.stdout + out.stderr + (tmp_path / "report" / "summary.json").read_text()


class Ran:
    """What ``extauthz simulate`` did in this process (no interpreter start per run)."""

    def __init__(self, capsys: pytest.CaptureFixture[str], *args: str) -> None:
        from extauthz.commands.cli import main

        try:
            self.returncode = main(["simulate", *args])
        except SystemExit as exc:  # argparse
            self.returncode = int(exc.code or 0)
        self.stdout, self.stderr = capsys.readouterr()


def test_the_failure_line_names_the_customer(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A fleet-wide figure that holds says which customer is behind it (named from
    --identities, else by hash)."""
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"],
              "--fail-on", "max_customer_refused_share > 0.5", "--fail-on", "critical_refused > 0",
              "--fail-on", "refused > 10")
    assert out.returncode == 3
    alice, payer = (f"{k} ({hash_identity(k, 'header:x-api-key')})" for k in ("alice", "payer"))
    assert ("--fail-on 'max_customer_refused_share > 0.5' holds: max_customer_refused_share = 0.65; "
            f"worst hit: customer {alice} (26 of 40 requests refused)") in out.stderr, out.stderr
    assert (f"--fail-on 'critical_refused > 0' holds: critical_refused = 6; most: customer {payer} "
            "(6 critical requests refused)") in out.stderr
    assert f"--fail-on 'refused > 10' holds: refused = 32; most refused: customer {alice} (26 of 40" in out.stderr
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"],
              "--fail-on", "max_customer_refused_share > 0.5")
    assert f"worst hit: customer {hash_identity('alice', 'header:x-api-key')} (26 of 40" in out.stderr


def test_fail_on_one_customer_by_hash_or_name(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """``customer:HASH refused > 1%`` (or a NAME of --identities): one customer's share (or
    count) of refusals; the output names the customer by NAME and hash."""
    bob = hash_identity("bob", "header:x-api-key")
    common = ("--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"])
    alice = hash_identity("alice", "header:x-api-key")
    out = Ran(capsys, *common, "--fail-on", "customer:alice refused > 1%", "--fail-on", f"customer:{bob} refused > 0",
              "--fail-on", f"customer:{alice.upper()} refused >= 26")
    assert out.returncode == 3
    assert (f"--fail-on 'customer:alice refused > 1%' holds: customer alice ({alice}): refused_share = 0.65; "
            "26 of 40 requests refused") in out.stderr, out.stderr
    # an upper-case hash is that hash (it was hashed again as a key: no request, never holds)
    assert f"--fail-on 'customer:{alice} refused >= 26' holds: customer alice ({alice}): refused = 26;" in out.stderr
    assert "customer:" + bob not in out.stderr  # bob is never refused
    absent = hash_identity("alcie", "header:x-api-key")
    out = Ran(capsys, *common, "--fail-on", f"customer:{bob} refused > 0",
              "--fail-on", "customer:alice refused_share > 0.66", "--fail-on", f"customer:{absent} refused > 0")
    assert out.returncode == 0
    assert (f"warning: --fail-on 'customer:{absent} refused > 0': no request of that customer in the traffic"
            in out.stderr), out.stderr


@pytest.mark.parametrize("expr", ["customer:sk_live_s3cret refused > 1%",  # refused after parsing
                                  "customer:sk_live_s3cret critical_refused > 0",  # a bad figure
                                  "customer:sk_live_s3cret refused >> 1",  # a bad expression
                                  "customer:sk_live_s3cret refused > baseline"])  # no baseline given
def test_a_key_in_fail_on_is_refused_and_never_printed(case: dict[str, str], capsys: pytest.CaptureFixture[str],
                                                       expr: str) -> None:
    """A key in ``customer:X`` lands in argv, shell history and CI logs, and the gate printed
    it in every line (the condition, the warning): it is refused now, never echoed."""
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"],
              "--identities", case["names"], "--fail-on", expr)
    assert out.returncode == 2, out.stderr
    assert "s3cret" not in out.stdout + out.stderr, out.stderr
    if expr.endswith("1%"):
        assert "never a key" in out.stderr and "extauthz hash" in out.stderr


def test_the_identities_file_shows_names_never_keys(case: dict[str, str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``NAME<TAB>KEY`` shows NAME; a key alone shows ``line N``; the key is in no output line,
    no JSON and no report (the whole line, the raw key, was the label)."""
    Path(case["names"]).write_text("# ours\nAlice Corp\t  alice  \npayer\n")
    summary = tmp_path / "s.json"
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"],
              "--json", str(summary), "--fail-on", "critical_refused > 0", "--fail-on", "refused > 10",
              "--fail-on", "customer:Alice Corp refused > 0")
    assert out.returncode == 2  # a NAME with a space is no token of the expression
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"],
              "--json", str(summary), "--fail-on", "critical_refused > 0", "--fail-on", "refused > 10")
    assert out.returncode == 3, out.stderr
    alice, payer = (hash_identity(k, "header:x-api-key") for k in ("alice", "payer"))
    assert f"most: customer line 3 ({payer})" in out.stderr, out.stderr
    assert f"most refused: customer Alice Corp ({alice})" in out.stderr
    labels = {row["identity"]: row.get("label") for row in json.loads(summary.read_text())["customers"]}
    assert labels == {alice: "Alice Corp", payer: "line 3"}
    everything = out.stdout + out.stderr + summary.read_text()
    assert "alice " not in everything and "payer" not in everything.replace(payer, "")


def test_an_ambiguous_key_in_the_identities_file_is_an_error_naming_the_line(
        case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A key holding different values joined by "," is never one identity on the server (it
    was hashed silently as a key nobody sends)."""
    Path(case["names"]).write_text("alice\talice\ntwo\tk1, k2\n")
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"])
    assert out.returncode == 2
    assert f"--identities {case['names']} line 2: the key holds different values separated by ','" in out.stderr
    assert "k1" not in out.stderr


def test_fail_on_against_the_baseline_replayed_or_a_baseline_run(
        case: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``FIGURE OP baseline [+|* N]``: with --baseline DIR (replayed beside the candidate) or
    --baseline-summary FILE (an earlier run's --json); without either it is a usage error."""
    common = ("--policies", case["candidate"], "--traffic", case["traffic"])
    out = Ran(capsys, *common, "--baseline", case["baseline"], "--identities", case["names"],
              "--fail-on", "refused > baseline + 30",
              "--fail-on", "customer:alice refused > baseline + 25", "--fail-on", "refused_share > baseline + 50%")
    assert out.returncode == 3
    assert "--fail-on 'refused > baseline + 30' holds: refused = 32 (baseline 0)" in out.stderr, out.stderr
    assert "--fail-on 'customer:alice refused > baseline + 25' holds: customer" in out.stderr
    assert "refused = 26 (baseline 0)" in out.stderr and "refused_share > baseline + 50%' holds" not in out.stderr
    # a baseline run's JSON: the candidate's own summary as the baseline refuses nothing more
    earlier = tmp_path / "baseline-run.json"
    assert Ran(capsys, *common, "--json", str(earlier)).returncode == 0
    out = Ran(capsys, *common, "--baseline-summary", str(earlier), "--fail-on", "refused > baseline",
              "--fail-on", "refused_share > baseline * 1.1")
    assert out.returncode == 0, out.stderr
    out = Ran(capsys, *common, "--baseline-summary", str(earlier), "--fail-on", "refused >= baseline")
    assert out.returncode == 3 and "refused = 32 (baseline 32)" in out.stderr
    out = Ran(capsys, *common, "--fail-on", "refused > baseline")
    assert out.returncode == 2 and out.stderr.startswith("extauthz simulate: error: --fail-on 'refused > "
                                                         "baseline' compares with the baseline"), out.stderr
    (tmp_path / "other.json").write_text('{"requests": 1}')
    out = Ran(capsys, *common, "--baseline-summary", str(tmp_path / "other.json"), "--fail-on", "refused > baseline")
    assert out.returncode == 2 and "not a simulate --json summary (no critical_refused" in out.stderr


def test_identities_that_match_no_request_are_listed(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    Path(case["names"]).write_text("# our customers\nalice\nalicee\npayer\n\nNo Body\tnobody\n")
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--identities", case["names"])
    assert out.returncode == 0
    assert ("warning: 2 of 4 --identities entries match no request (another --identity-salt or identity "
            f"rule, or no traffic): {case['names']} lines 3, 6") in out.stderr, out.stderr
    assert "alicee" not in out.stderr and "nobody" not in out.stderr  # line numbers, not the keys


def test_the_smallest_numbers_that_admit_each_refused_customer(
        case: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rate 1/s burst 5: alice's 40 requests, one every 0.25 s, need a burst of 40 - 9.75 s x 1/s
    = 30.25 (31 whole) at rate 1, or a rate of (40 - 5) / 9.75 s = 3.59/s at burst 5; payer's 20
    every 0.5 s: burst 20 - 9.5 = 10.5 (11), rate 15 / 9.5 = 1.58. Concurrency limit 2 and a
    quota of 3 a minute: carol's 4 overlapping requests need limit 4 for both."""
    out = Ran(capsys, "--policies", case["candidate"], "--traffic", case["traffic"], "--json", case["json"],
              "--identities", case["names"])
    assert out.returncode == 0, out.stderr
    rows = {r["label"]: r for r in json.loads(Path(case["json"]).read_text())["customers"]}
    assert rows["alice"]["would_admit"] == {"user-rate": {"burst": 31, "rate": 3.59,
                                                          "policy": {"rate": 1.0, "burst": 5.0}}}
    assert rows["payer"]["would_admit"]["user-rate"]["burst"] == 11
    assert rows["payer"]["would_admit"]["user-rate"]["rate"] == 1.58
    alice = hash_identity("alice", "header:x-api-key")
    assert (f"  alice ({alice}): user-rate would admit all 40 of its requests with burst 31 (at rate 1/s), "
            "or rate 3.59/s (at burst 5)") in out.stdout
    limits = policy_dir(tmp_path, [{"name": "conc", "type": "concurrent_requests", "limit": 2},
                                   {"name": "monthly", "type": "quota", "limit": 3, "period": "minute"}], "limits")
    carol = [line(T0 + i * 0.1, key="carol", duration=0.0) for i in range(4)]  # one at a time: 4 a minute
    dave = [line(T0 + i * 0.1, key="dave", duration=1.0) for i in range(3)]  # 3 at once, 3 a minute
    traffic = write_lines(tmp_path / "cd.jsonl", sorted(carol + dave, key=lambda x: x["time"]))
    out = Ran(capsys, "--policies", str(limits), "--traffic", str(traffic), "--json", case["json"])
    assert out.returncode == 0, out.stderr
    rows = {r["identity"]: r for r in json.loads(Path(case["json"]).read_text())["customers"]}
    assert rows[hash_identity("carol", "header:x-api-key")]["would_admit"] == {
        "monthly": {"limit": 4, "policy": {"limit": 3}}}
    assert rows[hash_identity("dave", "header:x-api-key")]["would_admit"] == {
        "conc": {"limit": 3, "policy": {"limit": 2}}}
    assert "conc would admit all 3 of its requests with limit 3 (the policy: 2)" in out.stdout


def test_the_bucket_rule_is_the_stores_and_no_rate_admits_a_crowd_at_one_instant() -> None:
    from extauthz.commands.simulate.advice import bucket_admits_all, bucket_advice
    from extauthz.core.verdict import Limits

    times = [0.0, 0.0, 0.0, 1.0]
    advice = bucket_advice(times, Limits(rate=1.0, burst=2.0, cost=1.0))
    assert advice == {"burst": 3, "rate": None}  # three at one instant: a burst of 3, no rate at 2
    assert bucket_admits_all(times, 1.0, 3.0, 1.0) and not bucket_admits_all(times, 1.0, 2.999, 1.0)
