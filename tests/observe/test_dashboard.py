"""The Grafana dashboard shipped in the chart (helm/extauthz/dashboards/extauthz.json): a
classic dashboard JSON model at the schema version current Grafana writes, with the panels
issue 22 lists, and every metric (and label value) a panel queries exported by a running
server after traffic that exercises every limiter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Mode
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc, auth_pb2_grpc
from tests.conftest import ROOT

from .helpers import FlakyStore, check_request, http, metrics_policy, running, samples, scrape, shed_half

DASHBOARD = ROOT / "helm" / "extauthz" / "dashboards" / "extauthz.json"
#: The classic model's schemaVersion that Grafana 12 writes and migrates older dashboards to
#: (LATEST_VERSION in grafana/grafana apps/dashboard/pkg/migration/schemaversion/migrations.go;
#: MIN_VERSION 21 is the oldest it migrates).
SCHEMA_VERSION = 41
#: The panels issue 22 asks for (titles as shipped).
PANELS = {
    "Decisions by limiter and outcome", "Refusals by tier", "Shadow would-refusals",
    "Fail-open by reason", "Store call latency", "Store errors", "Shed level", "Utilization",
    "Fleet in-flight against capacity", "Lease releases", "Verdicts by plan", "Overrides",
    # issue 34
    "Check latency by door", "Headroom: refused share by limiter", "Kill switches",
    "Policy version and reloads", "Recorder",
}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"])
           for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"]["query"])
            for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_dashboard_is_a_grafana_dashboard_at_the_current_schema_version() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] == SCHEMA_VERSION
    assert dash["title"] == "extauthz" and re.fullmatch(r"[A-Za-z0-9_-]{8,40}", dash["uid"])
    assert dash["graphTooltip"] in (0, 1, 2) and isinstance(dash["editable"], bool)
    assert set(dash["time"]) == {"from", "to"}
    assert "id" not in dash  # a provisioned dashboard gets its id from the Grafana it lands in
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["datasource"] == DATASOURCE
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "row"), p["title"]
        pos = p["gridPos"]
        assert pos["h"] > 0 and 0 < pos["w"] <= 24 and 0 <= pos["x"] < 24 and pos["y"] >= 0
        assert pos["x"] + pos["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            assert p["panels"] == [] and not p["collapsed"]
            continue
        assert p["description"] and p["datasource"] == DATASOURCE
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "rate(" not in t["expr"] or "[$__rate_interval]" in t["expr"], t["expr"]
    assert {p["title"] for p in dash["panels"] if p["type"] != "row"} == PANELS


async def test_every_metric_a_panel_queries_is_exported_after_traffic(tmp_path: Path) -> None:
    clock = ManualClock()
    store = FlakyStore(clock)
    policy = metrics_policy(tmp_path, {"name": "conc", "type": "concurrent_requests", "limit": 1})
    # recording on (the Recorder panel), both front doors (Check latency by door)
    async with running([policy.parent], store=store, clock=clock, record_dir=str(tmp_path / "rec"),
                       http_listen="127.0.0.1:0") as (server, client):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            auth = auth_pb2_grpc.AuthorizationStub(channel)
            req = check_request(headers={"x-api-key": "sk_live_alice"}, request_id="req-1")
            admitted = await auth.Check(req)
            assert admitted.HasField("ok_response")
            # alice's one concurrency slot is held; the shadow bucket (1) would refuse too
            assert await client.check("sk_live_alice") == 429
            # Envoy's access log for the admitted request releases its leases
            msg = accesslog_pb2.StreamAccessLogsMessage()
            entry = msg.http_logs.log_entry.add()
            entry.request.request_id = "req-1"
            entry.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].CopyFrom(
                admitted.dynamic_metadata)

            async def stream():  # type: ignore[no-untyped-def]
                yield msg

            await accesslog_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(stream())
        assert await client.check("sk_live_alice") == 200  # the slot came back
        status, _ = await http("GET", f"http://127.0.0.1:{server.http_port}/v1/customers",
                               headers={"x-api-key": "sk_live_dave"})
        assert status == 200  # the HTTP door
        store.fail = True  # every store-backed limiter fails open
        assert await client.check("sk_live_bob") == 200
        store.fail = False
        await shed_half(server, store, clock)
        assert await client.check("sk_test_carol") == 503  # the test tier is shed
        await server.control.set_switch("dark", Mode.OFF)  # a kill switch set
        assert server.leases is not None
        await server.leases.sample_once()
        text = await scrape(server)

    series = samples(text)
    labels: dict[str, list[dict[str, str]]] = {}
    for (name, pairs), _ in series.items():
        labels.setdefault(name, []).append(dict(pairs))

    def total(name: str, **want: str) -> float:
        return sum(v for (n, pairs), v in series.items() if n == name and want.items() <= dict(pairs).items())

    # the traffic reached every limiter, and every kind of event a panel shows happened
    for limiter in ("user-rate", "dark", "conc", "fleet", "workers"):
        assert total("extauthz_decisions_total", limiter=limiter) > 0, limiter
    assert total("extauthz_decisions_total", limiter="conc", outcome="denied") == 1
    assert total("extauthz_decisions_total", outcome="shadow_denied") > 0
    assert total("extauthz_fail_open_total", reason="unavailable") == 1
    assert total("extauthz_requests_total", result="shed") == 1
    assert total("extauthz_lease_releases_total", path="access_log", outcome="released") == 1
    assert total("extauthz_limiter_decisions_total", limiter="conc", outcome="denied") == 1
    for door in ("grpc", "http"):
        assert total("extauthz_check_duration_seconds_count", door=door) > 0, door
    assert total("extauthz_switches_set", switch="dark", mode="off") == 1
    assert total("extauthz_recorder_lines_total") > 0

    for where, expr in queries(dashboard()):
        names = re.findall(r"\bextauthz_[a-z_]+\b", expr)
        assert names, where
        for name in names:
            assert name in labels, f"{where}: {name} is not exported"
            for label, op, wanted in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', expr):
                if label == "job" or op == "!=":
                    continue  # job is Prometheus's scrape label
                for one in wanted.split("|") if op == "=~" else [wanted]:
                    assert any(s.get(label) == one for s in labels[name]), \
                        f"{where}: no {name} series with {label}={one!r}"
