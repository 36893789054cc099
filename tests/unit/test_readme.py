"""README.md as a new user follows it: the hand walkthrough's upstream listens on loopback
only, installs go into the project's venv, and the test command says how long it takes and
how to run a fast subset (with markers pytest knows)."""

from __future__ import annotations

import re
import tomllib

from ..conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_the_walkthrough_upstream_listens_on_loopback_only() -> None:
    servers = [line for line in README.splitlines() if "http.server" in line and "python" in line]
    assert servers, "the hand walkthrough starts an upstream with http.server"
    for line in servers:
        assert re.search(r"-b 127\.0\.0\.1\b", line), line


def test_every_pip_install_goes_into_the_venv() -> None:
    installs = re.findall(r"`([^`]*pip install[^`]*)`", README)
    assert any("tune" in cmd for cmd in installs)
    for cmd in installs:
        assert cmd.startswith(".venv/bin/pip install"), cmd


def test_the_test_command_says_its_duration_and_a_fast_subset() -> None:
    assert re.search(r"about \d+ minutes on a quiet 2-core", README) and "half an hour" in README
    # the workers scripts/test starts are the README's
    assert "-n 2 --dist loadfile" in (ROOT / "scripts" / "test").read_text() and "two pytest-xdist workers" in README
    subset = re.search(r'\./scripts/test -m "([^"]+)"', README)
    assert subset is not None and "EXTAUTHZ_SKIP_MIN_DEPS=1 ./scripts/test -m" in README
    declared = {m.split(":")[0] for m in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    used = set(re.findall(r"\b(?!not\b|and\b|or\b)(\w+)", subset.group(1)))
    assert used == {"slow", "e2e"} and used <= declared
