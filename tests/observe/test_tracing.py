"""Spans captured with the SDK's in-memory exporter: one span per Check, child of the
incoming ``traceparent`` (gRPC metadata, as Envoy sends it), the decision as attributes,
the store call as a child span, shadow would-denials as events."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from extauthz.observe.tracing import provider_from_env, tracing_requested

from .helpers import identity_of, rate, running, write_policy

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_check_span_is_a_child_of_the_incoming_traceparent(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1), rate("dark", burst=1, mode="shadow")])
    async with running([policy], tracer_provider=provider) as (_, client):
        md = (("traceparent", TRACEPARENT),)
        assert await client.check("sk_live_alice", metadata=md, request_id="req-1") == 200
        assert await client.check("sk_live_alice", metadata=md, request_id="req-2") == 429
    spans = exporter.get_finished_spans()
    checks = by_name(spans, "extauthz.check")
    assert len(checks) == 2
    first, second = checks
    for span in checks:
        assert span.kind is SpanKind.SERVER
        assert span.context.trace_id == TRACE_ID  # Envoy's trace
        assert span.parent is not None and span.parent.span_id == PARENT_ID and span.parent.is_remote
    a = first.attributes or {}
    assert a["extauthz.tier"] == "get"
    assert a["extauthz.tier_source"] == "default"
    assert a["extauthz.identity"] == identity_of("sk_live_alice")
    assert a["extauthz.identity_source"] == "header:x-api-key"
    assert a["extauthz.decision"] == "allowed"
    assert a["extauthz.limiter.user-rate.outcome"] == "allowed"
    assert a["extauthz.limiter.user-rate.remaining"] == 0
    assert a["extauthz.limiter.dark.outcome"] == "allowed"
    assert a["extauthz.request_id"] == "req-1"
    assert "extauthz.denied_by" not in a
    b = second.attributes or {}
    assert b["extauthz.decision"] == "denied"
    assert b["extauthz.denied_by"] == "user-rate"
    assert b["extauthz.http_status"] == 429
    assert b["extauthz.limiter.user-rate.outcome"] == "denied"
    assert b["extauthz.limiter.dark.outcome"] == "shadow_denied"
    # The shadow would-denial is an event on the check span.
    events = [e for e in second.events if e.name == "extauthz.shadow_denied"]
    assert len(events) == 1
    assert events[0].attributes is not None
    assert events[0].attributes["extauthz.limiter"] == "dark"
    assert events[0].attributes["extauthz.reason"] == "rate_exceeded"
    assert not [e for e in first.events if e.name == "extauthz.shadow_denied"]
    # The store call is a child span of each check span.
    stores = by_name(spans, "extauthz.store.check")
    assert len(stores) == 2
    for store_span, check_span in zip(stores, checks, strict=True):
        assert store_span.kind is SpanKind.CLIENT
        assert store_span.parent is not None and store_span.parent.span_id == check_span.context.span_id
        assert store_span.context.trace_id == TRACE_ID
        assert (store_span.attributes or {})["extauthz.store"] == "memory"


async def test_without_traceparent_the_check_span_is_a_root(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], tracer_provider=provider) as (_, client):
        await client.check("sk_live_alice")
    (check,) = by_name(exporter.get_finished_spans(), "extauthz.check")
    assert check.parent is None


async def test_a_not_sampled_parent_records_nothing(
        tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], tracer_provider=provider) as (_, client):
        assert await client.check("sk_live_alice", metadata=(("traceparent", TRACEPARENT[:-2] + "00"),)) == 200
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
])
def test_tracing_is_off_unless_the_otel_variables_ask(env: dict[str, str], on: bool) -> None:
    assert tracing_requested(env) is on
    provider = provider_from_env(env)
    assert (provider is not None) is on
    if provider is not None:
        assert provider.resource.attributes["service.name"] == "extauthz"
        provider.shutdown()


async def test_tracing_off_installs_nothing_on_the_request_path(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=5)])
    async with running([policy], metrics_listen="") as (server, _):
        assert server.observe.tracing is None
        assert type(server.auth).__name__ == "AuthorizationService"
        assert server.engine.gate.store_check == server.store.check  # no wrapper at all
