"""What the operator commands print: ``extauthz status`` (checks allowed and denied, what a shed
level means), ``extauthz report``'s headline, and errors said without Python's exception names."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from extauthz.commands import cli
from extauthz.observe.shadow import format_report

from .helpers import rate, running, write_policy

WORKERS = {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
           "delay_before_shedding": "30s", "time_to_shed_all": "60s"}


async def test_status_counts_checks_and_says_what_the_shed_level_means(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=2), WORKERS])
    async with running([policy]) as (server, client):
        statuses = [await client.check("sk_live_alice") for _ in range(5)]
        assert statuses == [200, 200, 429, 429, 429]
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["status", "--admin", url]) == 0
        out = capsys.readouterr().out
        assert "checks since start: 2 allowed, 3 denied (3 rate limited, 0 shed, 0 failed closed)" in out
        level = server.engine.snapshot.workers[0].level
        assert level < 0  # at rest: below 0 while the controller waits out delay_before_shedding
        assert f"shedder workers: utilization 0%, shed level {level:.2f} of 1: not shedding" in out
        assert "delay_before_shedding" in out
        assert await asyncio.to_thread(cli.main, ["status", "--admin", url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["checks"]["allowed"] == 2 and data["checks"]["rate_limited"] == 3
        assert data["checks"]["by_tier"]["get"] == {"allowed": 2, "rate_limited": 3, "shed": 0,
                                                     "failed_closed": 0}


def test_report_headline_counts_would_denials_not_log_entries() -> None:
    limiters = [{"limiter": "dark", "would_deny": 135, "identities": 2, "routes": 1, "tiers": {"get": 135},
                 "top_identities": [], "top_routes": []}]
    text = format_report({"window": 3600, "events": 2, "limiters": limiters})
    assert text.splitlines()[0] == "shadow would-denials in the last 3600 s: 135 by 1 limiter"
    assert "limiter dark: 135 would-denials" in text


def test_a_bad_report_window_names_the_flag_not_the_exception(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", "--admin", "http://127.0.0.1:1", "--window", "5x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("extauthz report: error: --window: bad duration '5x'"), err
    assert "ValueError" not in err


@pytest.mark.parametrize("window", ["inf", "nan", "-5", "0"])
def test_a_report_window_that_is_not_a_positive_finite_duration_is_refused_on_both_paths(
        window: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The admin port refused these (400); with --redis-url the command read from a window of
    # -inf (OverflowError), NaN (ValueError) or the future (an empty report, no error).
    for where in (["--admin", "http://127.0.0.1:1"], ["--redis-url", "redis://127.0.0.1:1"]):
        assert cli.main(["report", *where, "--window", window]) == 1
        err = capsys.readouterr().err
        assert err.startswith("extauthz report: error: --window: window must be a positive number of "
                              f"seconds or a duration like 15m, 1h or 24h (got '{window}')"), err
        assert cli.main(["report", *where, "--top", "0"]) == 1  # the Redis path printed no rows
        assert capsys.readouterr().err.startswith(
            "extauthz report: error: --top: top must be a whole number of rows from 1 to 1000 (got '0')")


def test_serve_with_a_malformed_listen_address_says_so_without_a_traceback(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=2)])
    out = subprocess.run([sys.executable, "-m", "extauthz", "serve", "--policies", str(policy),
                          "--listen", "127.0.0.1:0", "--admin-listen", "localhost", "--metrics-listen", "off",
                          "--admin-url-file", "off"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "extauthz serve: expected HOST:PORT, got 'localhost'" in out.stderr
    assert "Traceback" not in out.stderr and "ValueError" not in out.stderr


def test_demo_pictures_without_matplotlib_names_pictures_and_its_install(tmp_path: Path) -> None:
    # matplotlib made unimportable in a child interpreter (None in sys.modules: ImportError)
    code = ("import sys; sys.modules['matplotlib'] = None; from extauthz.commands.cli import main; "
            f"sys.exit(main(['demo', '--pictures', {str(tmp_path / 'pics')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    message = out.stdout + out.stderr
    assert "--pictures needs matplotlib: pip install 'extauthz[demo,tune]'" in message, message
    assert "--report" not in message
