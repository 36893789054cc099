"""Structured logs: one JSON object per line, a decision record per denial and shadow
would-denial; and no raw API key or Authorization value in any log line or span."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extauthz.core.clock import ManualClock
from extauthz.core.tiers import Tier
from extauthz.core.verdict import Decision, Kind, Outcome, Verdict
from extauthz.observe.logs import DecisionLog, JsonFormatter
from tests.unit.helpers import policy_from

from .helpers import identity_of, json_logs, rate, running, write_policy
from .test_metrics import FlakyStore

SECRET_KEY = "sk_live_SECRETkey1234567890"
SECRET_TOKEN = "tok_SECRETtoken0987654321"
SECRETS = ("SECRET", SECRET_KEY, SECRET_TOKEN)


def decision_records(lines: list[str]) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, lines) if r.get("event") == "decision"]


async def test_decision_records_for_denials_and_shadow_would_denials(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1), rate("dark", burst=1, mode="shadow")])
    with json_logs() as lines:
        async with running([policy]) as (_, client):
            assert await client.check("sk_live_erin", request_id="r-1") == 200
            assert await client.check("sk_live_erin", path="/v1/customers/cus_1", request_id="r-2") == 429
    for line in lines:
        assert isinstance(json.loads(line), dict)  # every line is one JSON object
    records = decision_records(lines)
    assert [(r["limiter"], r["outcome"]) for r in records] == [("user-rate", "denied"), ("dark", "shadow_denied")]
    denied = records[0]
    assert denied["identity"] == identity_of("sk_live_erin")
    assert denied["identity_source"] == "header:x-api-key"
    assert denied["tier"] == "get" and denied["route"] == "GET /v1/customers/cus_1"
    assert denied["remaining"] == 0 and denied["retry_after"] > 0 and denied["request_id"] == "r-2"
    assert denied["status"] == 429 and denied["level"] == "info" and denied["logger"] == "extauthz.decisions"
    assert records[1]["request_id"] == "r-2"


def test_a_flood_of_denials_is_capped_and_summarised(tmp_path: Path) -> None:
    clock = ManualClock()
    policy = policy_from(tmp_path, {"limiters": [rate("r", burst=1)]})
    logger = logging.getLogger("test.decisions.cap")
    with json_logs() as lines:
        dlog = DecisionLog(logger, max_per_second=3, clock=clock)
        verdict = Verdict("r", Kind.RATE_LIMITER, Outcome.DENIED, limit=1, remaining=0, retry_after=1)
        decision = Decision(False, Tier.GET, (verdict,), denied_by=verdict)
        from extauthz.core.context import RequestContext

        ctx = RequestContext(Tier.GET, "abc", "header:x-api-key", False, "GET", "/" + "x" * 300, "h", "default")
        for _ in range(10):
            dlog.decided(ctx, decision, policy)
        dlog.store_failed("timeout")
        dlog.flush()
        clock.advance(1)
        dlog.decided(ctx, decision, policy)
    records = [json.loads(line) for line in lines]
    assert len(decision_records(lines)) == 4
    assert len(decision_records(lines)[0]["route"]) == 100
    summary = [r for r in records if r.get("event") == "decisions_suppressed"]
    assert summary and summary[0]["count"] == 7
    failures = [r for r in records if r.get("event") == "store_failures"]
    assert failures and failures[0]["reasons"] == {"timeout": 1}
    assert dlog.suppressed_total == 7


def test_json_formatter_keeps_exceptions_on_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["msg"] == "failed here" and "ValueError: boom" in data["exc"]


def span_texts(exporter: InMemorySpanExporter) -> list[str]:
    out = []
    for span in exporter.get_finished_spans():
        out.append(span.name)
        out.append(json.dumps(dict(span.attributes or {}), default=str))
        for event in span.events:
            out.append(event.name + json.dumps(dict(event.attributes or {}), default=str))
    return out


async def test_no_raw_secret_in_any_log_line_or_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    policy_dir = tmp_path / "p"
    f = write_policy(policy_dir / "api.yaml", [rate("user-rate", burst=2), rate("dark", burst=1, mode="shadow"),
                                               {"name": "conc", "type": "concurrent_requests", "limit": 1}])
    store = FlakyStore()
    with json_logs() as lines:
        async with running([policy_dir], store=store, tracer_provider=provider,
                           reload_interval=0.05) as (server, client):
            bearer = {"authorization": f"Bearer {SECRET_TOKEN}"}
            statuses = [await client.check(SECRET_KEY, request_id="r") for _ in range(3)]
            statuses += [await client.check(None, headers=bearer) for _ in range(3)]
            statuses.append(await client.check(None, headers={"authorization": SECRET_TOKEN}))  # no Bearer
            store.fail = True
            statuses.append(await client.check(SECRET_KEY, headers=bearer))
            store.fail = False
            f.write_text(f.read_text() + f"\n# {SECRET_KEY}\nbogus: [\n")  # a broken reload, quoting a secret
            for _ in range(100):
                if server.watcher is not None and server.watcher.failures:
                    break
                await asyncio.sleep(0.02)
            assert server.watcher is not None and server.watcher.failures == 1
            server.observe.decision_log.flush()
    assert 429 in statuses
    records = decision_records(lines)
    assert {r["outcome"] for r in records} >= {"denied", "shadow_denied"}
    assert identity_of(SECRET_TOKEN, "header:authorization") in {r["identity"] for r in records}
    texts = lines + span_texts(exporter)
    assert len(span_texts(exporter)) > 10
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, text


async def test_key_values_are_hashed_and_a_missing_key_is_logged_and_counted(tmp_path: Path) -> None:
    """A keyed limiter's values (here a secret in a header) reach no log line, span or
    metric; a request without the keyed header is a ``skipped`` decision record and a
    count in ``extauthz_limiter_skipped_total``."""
    from .helpers import samples, scrape, value

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    policy = write_policy(tmp_path / "p.yaml", [{"name": "per-org", "type": "request_rate", "rate": 0.001,
                                                  "burst": 1, "key": [{"header": "x-org"}]}])
    with json_logs() as lines:
        async with running([policy], tracer_provider=provider) as (server, client):
            assert await client.check(SECRET_KEY, request_id="r-1") == 200  # no x-org: skipped
            assert await client.check(SECRET_KEY, headers={"x-org": SECRET_TOKEN}) == 200
            assert await client.check(SECRET_KEY, headers={"x-org": SECRET_TOKEN}) == 429
            metrics = await scrape(server)
    assert value(samples(metrics), "extauthz_limiter_skipped_total", limiter="per-org", reason="key_missing") == 1
    records = decision_records(lines)
    assert [(r["limiter"], r["outcome"], r["reason"]) for r in records] == [
        ("per-org", "skipped", "key_missing"), ("per-org", "denied", "rate_exceeded")]
    assert records[0]["request_id"] == "r-1" and records[0]["identity"] == identity_of(SECRET_KEY)
    for text in [*lines, *span_texts(exporter), metrics]:
        for secret in SECRETS:
            assert secret not in text, text
