"""``extauthz override``: refusals are clear, exit 1 and write nothing; the raw identity is
never printed."""

from __future__ import annotations

import pytest

from extauthz.cli import main


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


def test_bad_ttl(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "set", "user-rate", "--identity", "k", "rate=5", "--ttl", "31d",
                       "--admin", "http://127.0.0.1:9", "--redis-url", "")
    assert code == 1 and "bad duration '31d'" in err
    code, _, err = run(capsys, "set", "user-rate", "--identity", "k", "rate=5", "--ttl", "800h",
                       "--admin", "http://127.0.0.1:9", "--redis-url", "")
    assert code == 1 and "the TTL is at most 30 days" in err


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
    from extauthz.changelog import Change
    from extauthz.opscli import format_overrides

    rows = {"overrides": [{"limiter": "monthly", "identity": "ab12", "numbers": {"limit": 5000000.0},
                           "by": "ops", "set_at": 0, "expires_at": 60, "applied": True, "reason": "deal"}]}
    assert "limit=5000000 " in format_overrides(rows)
    assert "rate=0.0333333" in format_overrides(
        {"overrides": [{**rows["overrides"][0], "numbers": {"rate": 1 / 30}}]})
    assert "limit=5000000" in Change("override", "set", "monthly ab12", {"limit": 5000000.0}).describe()
