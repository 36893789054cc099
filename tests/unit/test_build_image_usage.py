"""scripts/build-image's command line: --help prints the usage, anything else is refused
before a build starts (it once took `--help` for nothing and began building wheels)."""

from __future__ import annotations

import subprocess

from ..conftest import ROOT

SCRIPT = ROOT / "scripts" / "build-image"


def test_help_prints_the_settings_and_builds_nothing() -> None:
    out = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Build the extauthz container image")
    for setting in ("BASE", "IMAGE", "TAG", "BUILDER", "PYTHON", "WHEELS", "BUILD_ARGS"):
        assert f"\n  {setting} " in out.stdout, setting
    assert "== wheels" not in out.stdout + out.stderr


def test_an_argument_is_refused_before_any_build() -> None:
    out = subprocess.run([str(SCRIPT), "--base", "x"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "takes no arguments" in out.stderr
    assert out.stdout == ""
