"""The ``extauthz`` command: subcommands listed, check-policies exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from extauthz.cli import main

from ..conftest import FIXTURES, ROOT


def test_help_lists_the_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "extauthz", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "check-policies", "schema", "switch", "report", "override", "demo"):
        assert command in out.stdout


def test_check_policies_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-policies", str(ROOT / "policies")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {ROOT / 'policies'} (version ")
    assert "user-rate (request_rate, enforce)" in out


def test_check_policies_reports_every_bad_path_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    bad = FIXTURES / "policies" / "bad" / "unknown_key.yaml"
    assert main(["check-policies", str(ROOT / "policies"), str(bad)]) == 1
    captured = capsys.readouterr()
    assert "ok: " in captured.out  # the good one is still checked and reported
    assert f"error: {bad}:6: limiters[0].burts: unknown field" in captured.err


def test_schema_prints_the_published_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((ROOT / "docs" / "policy.schema.json").read_text())
