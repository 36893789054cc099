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

from extauthz.classify import hash_identity
from extauthz.simulate.traffic import write_lines

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
    names.write_text("# our customers\nalice\npayer\n")
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
    ("refused >> 1", "expected FIGURE OP NUMBER"),
    ("refused > many", "expected FIGURE OP NUMBER"),
    ("refused > 1e999", "not a finite number"),
    ("refused", "expected FIGURE OP NUMBER"),
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
    assert [c.get("label") for c in s["customers"]][:1] == ["sk_live_batchjob"]
