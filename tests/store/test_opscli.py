"""The operator commands (extauthz/opscli.py) against a real Redis: the options they share
with serve come from extauthz/settings.py, variables included."""

from __future__ import annotations

import json

import pytest

from extauthz.cli import main


@pytest.mark.redis
@pytest.mark.parametrize("command", [["switch", "--list"], ["history", "--json"], ["report", "--json"]])
def test_redis_url_falls_back_to_the_variable_for_every_command_that_takes_it(
        command: list[str], redis_single_clean, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    """EXTAUTHZ_REDIS_URL and EXTAUTHZ_KEY_PREFIX, as serve reads them, reach the fleet's
    Redis without --redis-url (it was `override` only); an admin port given wins."""
    monkeypatch.setenv("EXTAUTHZ_REDIS_URL", redis_single_clean.url)
    monkeypatch.setenv("EXTAUTHZ_KEY_PREFIX", "opscli-settings")
    monkeypatch.setenv("EXTAUTHZ_ADMIN_URL", "http://127.0.0.1:1")  # an admin port nobody serves
    assert main(["switch", "user-rate", "shadow", "--reason", "test"]) == 0
    capsys.readouterr()
    assert main(command) == 0
    out = capsys.readouterr().out
    if command[0] == "switch":
        assert 'switches: {"user-rate": "shadow"}' in out
    elif command[0] == "history":
        assert [(c["target"], c["reason"]) for c in json.loads(out)["changes"]] == [("user-rate", "test")]
    assert main([*command, "--admin", "http://127.0.0.1:1"]) == 1  # explicit admin: no Redis
    assert "cannot reach the admin port at http://127.0.0.1:1" in capsys.readouterr().err
