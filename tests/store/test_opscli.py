"""The operator commands (extauthz/commands/opscli.py) against a real Redis: the options they share
with serve come from extauthz/core/settings.py, variables included."""

from __future__ import annotations

import json

import pytest

from extauthz.commands.cli import main


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


@pytest.mark.redis
async def test_inspect_with_redis_url_reads_the_fleets_counters_without_changing_them(
        redis_single_clean, tmp_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    """`extauthz inspect - --redis-url` reads the bucket and the leases a server keyed for the
    key's hash (the hash `extauthz hash` prints), and reading them twice gives one answer."""
    import asyncio
    import io

    from extauthz.store.base import BucketOp, LeaseOp
    from extauthz.store.keys import Keys
    from extauthz.store.redis import RedisStore
    from tests.observe.helpers import SALT, rate, write_policy

    pol = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=5),
                                                     {"name": "per-user", "type": "concurrent_requests", "limit": 4}])
    base = ["--policies", str(pol.parent), "--identity-salt", SALT]
    monkeypatch.setattr("sys.stdin", io.StringIO("sk_live_redis\n"))
    assert await asyncio.to_thread(main, ["hash", "-", *base]) == 0
    hashed = capsys.readouterr().out.strip()
    keys = Keys("insp")
    store = RedisStore.from_url(redis_single_clean.url)
    try:  # what a server admits for that customer: 2 requests of 1 token (rate 0.001/s), 1 in flight
        for i in range(2):
            assert (await store.check([BucketOp(keys.bucket("user-rate", hashed), 0.001, 5.0, 1.0)], f"l{i}")).admitted
        assert (await store.check([LeaseOp(keys.user_leases("per-user", hashed), 4, 60.0)], "l9")).admitted
    finally:
        await store.close()
    args = ["inspect", "--identity-hash", hashed, "--redis-url", redis_single_clean.url, "--key-prefix", "insp",
            *base, "--json"]
    answers = []
    for _ in range(2):
        assert await asyncio.to_thread(main, args) == 0
        answers.append({r["limiter"]: r.get("live") for r in json.loads(capsys.readouterr().out)["limiters"]})
    assert answers[0]["user-rate"]["tokens"] == pytest.approx(3.0, abs=0.01)
    assert answers[0]["per-user"] == {"in_flight": 1, "left": 3}
    assert answers[1]["user-rate"]["tokens"] == pytest.approx(3.0, abs=0.01)  # unchanged by the peek
    assert await asyncio.to_thread(main, args[:-5]) == 1  # no --policies: said, not guessed
    assert "--policies names the fleet's policy" in capsys.readouterr().err
