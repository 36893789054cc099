"""A running server's /status and /metrics, built from the per-component parts
(extauthz/engine/state.py) by server/panel.py: the /status document keeps every key operators
read, in its order, and a count shown on /status is the one /metrics exports."""

from __future__ import annotations

from pathlib import Path

from extauthz.commands.opscli import format_status
from tests.observe.helpers import admin, rate, running, scrape, write_policy

STATUS_KEYS = [
    "extauthz", "policy", "reload", "store", "checks", "fail_open", "unchecked_requests", "overload",
    "bad_requests",
    "background_errors", "switches", "limiters", "switch_poll", "overrides", "shedding",
    "leases_in_flight", "access_log", "lease_releases", "shadow", "decision_log",
    "observer_errors", "tracing", "tls", "admin", "changes", "change_log_errors", "grpc",
    "grants", "recorder", "ratelimit_descriptors", "ratelimit_limit_overrides", "ratelimit_detailed", "quota",
]


def sample(metrics: str, prefix: str) -> float:
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])


async def test_status_keeps_its_keys_and_agrees_with_metrics(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    async with running([policy]) as (server, client):
        assert [await client.check("sk_live_a") for _ in range(2)] == [200, 429]
        assert (await admin(server, "PUT", "/switches/user-rate", "shadow"))[0] == 200
        code, status = await admin(server, "GET", "/status")
        metrics = await scrape(server)
    assert code == 200 and list(status) == STATUS_KEYS
    assert status["switches"] == {"user-rate": "shadow"}
    assert sample(metrics, 'extauthz_switches_set{mode="shadow",switch="user-rate"}') == 1
    assert sample(metrics, 'extauthz_limiter_mode{limiter="user-rate",mode="shadow"}') == 1
    assert status["switch_poll"]["updates"] == 1
    assert sample(metrics, "extauthz_bad_requests_total") == status["bad_requests"] == 0
    assert sample(metrics, 'extauthz_fail_open_total{reason="overload"}') == status["fail_open"].get("overload", 0)
    assert sample(metrics, "extauthz_loop_lag_seconds") >= 0 and not status["overload"]["starved"]
    assert sample(metrics, f'extauthz_policy_info{{version="{status["policy"]["version"]}"}}') == 1
    assert sample(metrics, "extauthz_access_log_entries_total") == status["access_log"]["entries"]
    assert sample(metrics, "extauthz_grpc_calls_total") == status["grpc"]["calls"]
    assert sample(metrics, 'extauthz_unchecked_requests_total{tier="critical"}') == 0
    assert status["unchecked_requests"] == {"total": 0, "by_tier": dict.fromkeys(
        ("critical", "post", "get", "test", "unknown"), 0), "fleet": {"in_flight": 0, "counted": 0, "errors": 0}}
    assert sample(metrics, 'extauthz_overrides{applied="yes"}') == status["overrides"]["live"] == 0
    assert status["recorder"] is None and "extauthz_recorder_lines" not in metrics  # not recording


async def test_the_recorder_is_on_status_and_metrics(tmp_path: Path) -> None:
    """serve --record: /status ``recorder`` (docs/tuning.md's lines_dropped among them), the
    same counts as extauthz_recorder_*, and a line in ``extauthz status``."""
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    async with running([policy], record_dir=str(tmp_path / "record")) as (server, client):
        assert [await client.check("sk_live_a") for _ in range(3)] == [200, 429, 429]
        assert server.recorder is not None
        await server.recorder.flush()
        server.recorder.writer.lines_dropped += 2  # as a line larger than a file would (test_record.py)
        code, status = await admin(server, "GET", "/status")
        metrics = await scrape(server)
    assert code == 200
    rec = status["recorder"]
    assert (rec["recorded"], rec["lines_dropped"], rec["write_errors"]) == (3, 2, 0)
    assert rec["directory"] == str(tmp_path / "record") and rec["bytes_written"] > 0
    assert sample(metrics, "extauthz_recorder_lines_total") == 3
    assert sample(metrics, "extauthz_recorder_lines_dropped_total") == 2
    assert sample(metrics, "extauthz_recorder_write_errors_total") == 0
    assert sample(metrics, "extauthz_recorder_bytes_written_total") == rec["bytes_written"]
    assert sample(metrics, "extauthz_recorder_pending ") == 0
    assert (f"recorder: 3 lines recorded into {tmp_path / 'record'}, 2 dropped, 0 write errors"
            in format_status(status))
