"""The plan is a label everywhere a decision is told: the decision log record, the check
span's attributes and the decisions metric (through a running server and a real gRPC call)."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from .helpers import json_logs, running, samples, scrape

POLICY = """\
version: 1
identity:
  - header: x-api-key
plan:
  from: [{header: x-plan}]
  default: free
limiters:
  - name: user-rate
    type: request_rate
    rate: 1
    burst: 1
    plans:
      pro: {rate: 1, burst: 2}
"""


async def test_the_plan_labels_decision_logs_spans_and_metrics(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with json_logs() as lines:
        async with running([policy], tracer_provider=provider) as (server, client):
            pro = {"x-plan": "pro"}
            assert [await client.check("sk_live_p", headers=pro) for _ in range(3)] == [200, 200, 429]
            assert [await client.check("sk_live_u", headers={"x-plan": "gold"}) for _ in range(2)] == [200, 429]
            text = await scrape(server)
    records = [r for r in map(json.loads, lines) if r.get("event") == "decision"]
    assert [(r["plan"], r["plan_source"]) for r in records] == [("pro", "header:x-plan"), ("free", "unknown")]
    checks = [s for s in exporter.get_finished_spans() if s.name == "extauthz.check"]
    assert [(s.attributes or {}).get("extauthz.plan") for s in checks] == ["pro"] * 3 + ["free"] * 2
    assert (checks[-1].attributes or {}).get("extauthz.plan_source") == "unknown"
    got = samples(text)

    def decisions(plan: str, outcome: str) -> float:
        return got[("extauthz_decisions_total", frozenset({
            ("limiter", "user-rate"), ("tier", "get"), ("plan", plan), ("outcome", outcome)}))]

    assert (decisions("pro", "allowed"), decisions("pro", "denied")) == (2.0, 1.0)
    assert (decisions("free", "allowed"), decisions("free", "denied")) == (1.0, 1.0)
    assert got[("extauthz_plan_unknown_total", frozenset())] == 2.0
