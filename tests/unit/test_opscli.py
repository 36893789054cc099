"""``extauthz override``: refusals are clear, exit 1 and write nothing; the raw identity is
never printed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from extauthz.commands.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["override", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("numbers", "message"), [
    (["burst=5", "cost=6"], "cost (6) is larger than burst (5): no request could ever pass"),
    (["rate"], "expected NAME=VALUE (rate=1000 burst=5000, or limit=200), got 'rate'"),
    (["limit=1.5"], "limit: Input should be a valid integer"),
    (["speed=3"], "speed: not a number of this limiter kind"),
])
def test_bad_numbers_are_refused_before_anything_is_sent(
        capsys: pytest.CaptureFixture[str], numbers: list[str], message: str) -> None:
    # an admin URL nobody listens on: a refusal must come before any call
    code, out, err = run(capsys, "set", "user-rate", "--identity", "sk_live_secret", *numbers,
                         "--admin", "http://127.0.0.1:9", "--redis-url", "")
    assert code == 1 and message in err, err
    assert "sk_live_secret" not in out + err


NOWHERE = ("--admin", "http://127.0.0.1:9", "--redis-url", "")


@pytest.mark.parametrize(("ttl", "message"), [
    (["--ttl", "800h"], "the TTL is at most 30 days, 720h (got 33.33 days, 800h)"),
    (["--ttl", "31d"], "the TTL is at most 30 days, 720h (got 31 days, 744h)"),
    (["--ttl", "721h"], "(got 30.04 days, 721h)"),  # said "got 30.0417", no unit
    (["--ttl", "-1h"], "the TTL must be positive, not '-1h': an override lasts a duration like 30m, 24h or 7d"),
    (["--ttl=-1h"], "the TTL must be positive, not '-1h'"),
    (["--ttl", "-90"], "the TTL must be positive, not '-90'"),
    (["--ttl", "1w"], "bad TTL '1w': use seconds or a duration like 30m, 24h or 7d (units ms, s, m, h, d)"),
])
def test_bad_ttl_says_why_with_units(capsys: pytest.CaptureFixture[str], ttl: list[str], message: str) -> None:
    code, _, err = run(capsys, "set", "user-rate", "--identity", "k", "rate=5", *ttl, *NOWHERE)
    assert code == 1 and err.startswith("extauthz override set: error: ") and message in err, err
    assert "expected one argument" not in err


def test_a_ttl_in_days_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.control.overrides import parse_ttl

    assert parse_ttl("7d") == 7 * 86400 and parse_ttl("1.5d") == 1.5 * 86400 and parse_ttl("30d") == 30 * 86400
    # a valid TTL passes every check: the command goes on to the (unreachable) admin port
    code, _, err = run(capsys, "set", "user-rate", "--identity", "k", "rate=5", "--ttl", "7d", *NOWHERE)
    assert code == 1 and "cannot reach the admin port" in err, err


def test_an_unreachable_admin_port_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "list", "--admin", "http://127.0.0.1:9", "--redis-url", "")
    assert code == 1 and "cannot reach the admin port" in err and "Traceback" not in err


def test_an_explicit_admin_port_wins_over_the_redis_url_of_the_environment(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/operations.md exports EXTAUTHZ_REDIS_URL, then shows a set with --admin for the
    # embedded store: that must go to the admin port, not silently to the Redis.
    monkeypatch.setenv("EXTAUTHZ_REDIS_URL", "redis://127.0.0.1:9/0")
    code, _, err = run(capsys, "list", "--admin", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the admin port" in err, err
    code, _, err = run(capsys, "list", "--admin", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9/0")
    assert code == 1 and "give either --redis-url or --admin/--listen, not both" in err, err


def test_numbers_print_whole_not_in_scientific_notation() -> None:
    """`override set/list` and `history` said limit=5e+06 for a monthly quota of 5,000,000."""
    from extauthz.commands.opscli import format_overrides
    from extauthz.control.changelog import Change

    rows = {"overrides": [{"limiter": "monthly", "identity": "ab12", "numbers": {"limit": 5000000.0},
                           "by": "ops", "set_at": 0, "expires_at": 60, "applied": True, "reason": "deal"}]}
    assert "limit=5000000 " in format_overrides(rows)
    assert "rate=0.0333333" in format_overrides(
        {"overrides": [{**rows["overrides"][0], "numbers": {"rate": 1 / 30}}]})
    assert "limit=5000000" in Change("override", "set", "monthly ab12", {"limit": 5000000.0}).describe()


@pytest.mark.parametrize(("argv", "message"), [
    (["switch", "user-rate", "off", "--reason", "incident\r\n2026-01-01T00:00:00Z switch * off"],
     "--reason holds a control character (\\r at position 9)"),
    (["switch", "user-rate", "off", "--reason", "ok", "--by", "\x1b[31mroot"],
     "--by holds a control character (\\x1b at position 1)"),
    (["override", "set", "user-rate", "--identity", "k", "rate=5", "--reason", "a\u202eb"],
     "--reason holds a control character (\\u202e at position 2)"),
])
@pytest.mark.parametrize("where", [["--admin", "http://127.0.0.1:9", "--redis-url", ""],
                                   ["--redis-url", "redis://127.0.0.1:9/0"]])
def test_a_control_character_in_a_reason_or_user_is_refused_before_anything_is_sent(
        capsys: pytest.CaptureFixture[str], argv: list[str], message: str, where: list[str]) -> None:
    # Issue 29: a CR/LF in a reason forged a line of `extauthz history`, an escape sequence
    # recoloured the terminal. Nobody listens at either address: the refusal comes first.
    code = main([*argv, *where])
    _, err = capsys.readouterr()
    assert code == 1 and message in err, err
    assert "cannot reach" not in err and "Connection" not in err


async def test_the_store_control_refuses_a_control_character() -> None:
    from extauthz.control.control import ControlError, StoreControl
    from extauthz.store.keys import Keys
    from extauthz.store.memory import MemoryStore

    with pytest.raises(ControlError, match=r"the reason holds a control character \(\\n at position 2\)"):
        StoreControl(MemoryStore(), Keys("t"), reason="a\nb")
    with pytest.raises(ControlError, match=r"the user holds a control character"):
        StoreControl(MemoryStore(), Keys("t"), user="\x07bob")


def test_history_and_override_rows_print_stored_control_characters_escaped() -> None:
    # a record an older version stored (or one written straight into Redis)
    from extauthz.commands.opscli import format_overrides
    from extauthz.control.changelog import Change, format_history

    change = Change(kind="switch", action="set", target="*", value="off", at=0.0, server="h", via="redis",
                    reason="x\r\n1970-01-01T00:00:00Z switch set * off", user="\x1b]0;pwned\x07eve")
    text = format_history([change])
    assert len(text.splitlines()) == 2 and "\x1b" not in text and "\r" not in text
    assert "x\\r\\n1970-01-01T00:00:00Z" in text and "\\x1b]0;pwned\\x07eve" in text
    rows = format_overrides({"max": 1, "overrides": [{
        "limiter": "l", "identity": "ab" * 12, "numbers": {"rate": 1}, "by": "\x9bbob", "set_at": 0,
        "expires_at": 1, "applied": True, "reason": "a\nb"}]})
    assert len(rows.splitlines()) == 3 and "a\\nb" in rows and "\\x9bbob" in rows


@pytest.mark.parametrize(("argv", "command", "says"), [
    (["switch", "--bogus"], "switch", "unrecognized arguments: --bogus"),  # argparse's own
    (["switch", "user-rate", *NOWHERE], "switch", "usage: extauthz switch NAME"),
    (["report", "--window", "5x", *NOWHERE], "report", "--window: bad duration '5x'"),
    (["status", "--admin", "http://127.0.0.1:9"], "status", "cannot reach the admin port"),
    (["history", "--last", "0", *NOWHERE], "history", "--last must be at least 1"),
    (["override", "clear", "user-rate", "--identity", "", *NOWHERE], "override clear", "--identity is empty"),
    (["override", "set", "user-rate", "--identity", "k", "rate=5", "--policies", "/nonexistent", *NOWHERE],
     "override set", "PolicyError"),
    (["simulate", "--policies", "/nonexistent", "--traffic", "t.jsonl"], "simulate", "/nonexistent"),
    # the one key hasher's ambiguous-value error names the flag the user gave (it said --identity)
    (["hash", "k1, k2"], "hash", "KEY holds different values separated by ','"),
    (["override", "clear", "user-rate", "--identity", "k1,k2", *NOWHERE], "override clear",
     "--identity holds different values"),
    # a key given as --identity-hash is not echoed back
    (["inspect", "--identity-hash", "sk_live_s3cret", *NOWHERE], "inspect", "not an identity hash (24 hex"),
])
def test_every_operator_command_says_errors_in_one_form(
        capsys: pytest.CaptureFixture[str], argv: list[str], command: str, says: str) -> None:
    """``extauthz COMMAND: error: MESSAGE``, argparse's form, from argparse and the commands alike."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code in (1, 2) and last.startswith(f"extauthz {command}: error: ") and says in last, err


def test_a_mistyped_limiter_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    from ..conftest import ROOT

    code, _, err = run(capsys, "set", "usr-rate", "--identity", "k", "rate=5", "--policies",
                       str(ROOT / "policies"), *NOWHERE)
    assert code == 1 and err.strip().endswith("the policy has no limiter named 'usr-rate' "
                                              "(did you mean 'user-rate'?)"), err


@pytest.mark.parametrize("where", [NOWHERE, ("--redis-url", "redis://127.0.0.1:9/0")])
def test_a_switch_for_a_limiter_the_given_policy_lacks_is_refused_before_anything_is_sent(
        capsys: pytest.CaptureFixture[str], where: tuple[str, ...]) -> None:
    """With --policies, the control's own rule (extauthz/control/control.py check_switch) refuses the
    name here, on either path, in the admin port's words; nobody listens at either address."""
    from ..conftest import ROOT

    code = main(["switch", "usr-rate", "off", *where, "--policies", str(ROOT / "policies")])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == ("extauthz switch: error: no limiter named 'usr-rate' in the "
                                         "policy (did you mean 'user-rate'?)"), err


async def test_status_says_which_admin_tokens_are_in_force_when_the_file_is_bad(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29 review: the line ended ``keeping the 2 tokens read before (None)``, from a key
    the server never sends."""
    from tests.conftest import ROOT
    from tests.observe.helpers import admin, running

    token = "ci-token-fedcba9876543210"
    tokens, mine = tmp_path / "admin-tokens", tmp_path / "my-token"
    tokens.write_text(f"ci:{token}\nalice:alice-token-0123456789abcdef\n")
    mine.write_text(token + "\n")
    monkeypatch.setenv("EXTAUTHZ_ADMIN_TOKEN_FILE", str(mine))
    async with running([ROOT / "policies"], admin_token_file=str(tokens)) as (server, _):
        tokens.write_text(f"ci:{token}\nbob:short\n")  # line 2 bad: the 2 tokens read before stay
        assert (await admin(server, "GET", "/status", headers={"Authorization": f"Bearer {token}"}))[0] == 200
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        code = await asyncio.to_thread(main, ["status", "--admin", url])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("admin token file NOT read again")]
    assert line.endswith("; keeping the 2 tokens read before"), line


def test_a_key_given_as_identity_hash_is_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    """A key pasted as --identity-hash by mistake stays out of the error (it was echoed)."""
    code = main(["inspect", "--identity-hash", "sk_live_s3cret", *NOWHERE])
    err = capsys.readouterr().err
    assert code == 1 and "not an identity hash" in err and "s3cret" not in err, err
    # an upper-case hash with a newline is a hash (lower-cased), not "not a hash"
    code = main(["inspect", "--identity-hash", "AB" * 12 + "\n", *NOWHERE])
    assert "not an identity hash" not in capsys.readouterr().err
