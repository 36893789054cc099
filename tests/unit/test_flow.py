"""The one check flow (server/flow.py) on the embedded store and an injected clock: both front
doors (the gRPC servicer and the HTTP port) run the same steps and answer one decision alike;
the lease bookkeeping (index, ticket, a lost answer given back) and the bad-request count are
the flow's, whichever door the request came through."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from extauthz.core.clock import ManualClock
from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.engine.engine import Engine
from extauthz.proto import auth_pb2
from extauthz.server.flow import CheckFlow
from extauthz.server.http import HttpAuthorization, Request
from extauthz.server.leases import Leases, seen_as, seen_at
from extauthz.server.services import AuthorizationService
from extauthz.server.traced import check_flow

from .helpers import engine_for, policy_from

LIMITERS = {"limiters": [
    {"name": "rate", "type": "request_rate", "rate": 1, "burst": 2},
    {"name": "conc", "type": "concurrent_requests", "limit": 5, "lease_ttl": "60s"},
]}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Call:
    """A gRPC call as the servicer sees it: done callbacks, run by :meth:`finish`."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.callbacks: list[Callable[[Call], None]] = []
        self.was_cancelled = False
        self.metadata = metadata

    def add_done_callback(self, callback: Callable[[Call], None]) -> None:
        self.callbacks.append(callback)

    def cancelled(self) -> bool:
        return self.was_cancelled

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def finish(self, *, cancelled: bool) -> None:
        self.was_cancelled = cancelled
        for callback in self.callbacks:
            callback(self)


class Connection:
    """What the HTTP door asks of its connection: whether it is closed."""

    def __init__(self, closed: bool = False) -> None:
        self.closed = closed


def doors(tmp_path: Path, tracer: Any = None) -> tuple[Engine, CheckFlow, AuthorizationService, HttpAuthorization]:
    engine, _ = engine_for(policy_from(tmp_path, LIMITERS), ManualClock())
    flow = check_flow(engine, Leases(engine), tracer)
    return engine, flow, AuthorizationService(flow), HttpAuthorization(flow)


def check_request(key: str, request_id: str = "", started_us: int = 0, path: str = "/v1/x") -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = "GET", path, "api.example.com"
    http.headers["x-api-key"] = key
    if request_id:
        http.headers["x-request-id"] = request_id
    if started_us:
        req.attributes.request.time.FromMicroseconds(started_us)
    return req


def http_request(key: str, request_id: str = "", path: str = "/v1/x", **more: str) -> Request:
    headers = {"host": "api.example.com", "x-api-key": key, **more}
    if request_id:
        headers["x-request-id"] = request_id
    return ("GET", path, headers, True)


def http_parts(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def grpc_headers(resp: auth_pb2.CheckResponse) -> dict[str, str]:
    if resp.HasField("denied_response"):
        return {h.header.key: h.header.value for h in resp.denied_response.headers}
    ok = resp.ok_response
    out = {h.header.key: h.header.value for h in [*ok.headers, *ok.response_headers_to_add]}
    out.update({k: v.string_value for k, v in resp.dynamic_metadata.fields.items()})
    return out


def test_both_doors_answer_one_decision_alike(tmp_path: Path) -> None:
    engine, flow, grpc_door, http_door = doors(tmp_path)
    grpc_msg, http_msg = check_request("sk_live_a"), http_request("sk_live_a")
    snap = engine.snapshot
    # the two doors read the same request into the same context
    ctx = snap.classifier.context(grpc_door.read(grpc_msg, snap))
    assert snap.classifier.context(http_door.read(http_msg, snap)) == ctx
    for expect_status in (200, 200, 429):  # burst 2, then refused
        decision = asyncio.run(engine.decide(ctx))
        ticket = flow.leases.admitted(ctx, decision, "") if decision.leases else ""
        grpc_answer = grpc_door.answer(grpc_msg, ctx, decision, ticket)
        status, headers, body = http_parts(http_door.answer(http_msg, ctx, decision, ticket))
        assert status == expect_status
        expected = grpc_headers(grpc_answer)
        assert {k: headers[k] for k in expected} == expected  # every gRPC header, the same value
        if status == 200:
            assert grpc_answer.HasField("ok_response") and ticket
            assert expected[LEASE_TICKET_FIELD] == ticket and LEASES_FIELD in expected
        else:
            assert grpc_answer.denied_response.status.code == 429
            assert json.loads(body) == json.loads(grpc_answer.denied_response.body)


def test_an_admitted_check_is_indexed_with_what_each_door_saw(tmp_path: Path) -> None:
    _, flow, grpc_door, http_door = doors(tmp_path)
    call = Call()
    resp = asyncio.run(flow.check(grpc_door, check_request("sk_live_a", "rid-g", 1_000_000_123), call))
    status, headers, _ = http_parts(asyncio.run(flow.check(http_door, http_request("sk_live_b", "rid-h"),
                                                           Connection())))
    assert status == 200
    index = flow.leases.index
    assert len(index) == 2
    g = resp.dynamic_metadata.fields
    # an entry without our metadata finds the check by what the check saw: the gRPC door's
    # start time, the HTTP door's method and path
    assert index.take("rid-g", None, (seen_as("GET", "/v1/x"),)) is None
    assert index.take("rid-g", None, (seen_at(1_000_000_123),)) == (
        (g[LEASES_FIELD].string_value,), g[LEASE_ID_FIELD].string_value)
    assert index.take("rid-h", None, (seen_as("GET", "/v1/x"),)) == (
        (headers[LEASES_FIELD],), headers[LEASE_ID_FIELD])
    call.finish(cancelled=False)  # answered: nothing given back
    assert flow.leases.releaser.count("cancelled_check") == 0


def test_a_grpc_check_without_a_start_time_is_indexed_by_method_and_path(tmp_path: Path) -> None:
    _, flow, grpc_door, _ = doors(tmp_path)
    asyncio.run(flow.check(grpc_door, check_request("sk_live_a", "rid", path="/v1/y?q=1"), Call()))
    assert flow.leases.index.take("rid", None, (seen_as("GET", "/v1/y"),)) is not None


def test_an_answer_envoy_drops_gives_its_leases_back(tmp_path: Path) -> None:
    _, flow, grpc_door, http_door = doors(tmp_path)
    releaser = flow.leases.releaser
    call = Call()
    asyncio.run(flow.check(grpc_door, check_request("sk_live_a", "rid-g"), call))
    assert releaser.count("cancelled_check") == 0
    call.finish(cancelled=True)  # Envoy reset the call after the answer
    assert releaser.count("cancelled_check", "released") == 1
    # the HTTP connection closed while the check was decided: no ticket, no index entry
    status, headers, _ = http_parts(asyncio.run(flow.check(http_door, http_request("sk_live_b", "rid-h"),
                                                           Connection(closed=True))))
    assert status == 200 and LEASE_TICKET_FIELD not in headers
    assert releaser.count("cancelled_check", "released") == 2
    assert flow.leases.index.take("rid-h", None, (seen_as("GET", "/v1/x"),)) is None
    assert releaser.leases_released == 2


def test_a_request_a_door_cannot_read_is_allowed_and_counted_by_the_flow(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, flow, grpc_door, http_door = doors(tmp_path)
    resp = asyncio.run(flow.check(grpc_door, None, Call()))  # type: ignore[arg-type]
    assert resp.HasField("ok_response") and not resp.ok_response.headers
    unreadable: Request = ("GET", None, {}, False)  # type: ignore[assignment]
    raw = asyncio.run(flow.check(http_door, unreadable, Connection()))
    assert raw == b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    assert flow.bad_requests == 2
    said = [r.getMessage() for r in caplog.records if "could not read" in r.getMessage()]
    assert said and "a CheckRequest" in said[0]


def test_tracing_puts_each_door_s_check_in_one_span_under_its_traceparent(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _, flow, grpc_door, http_door = doors(tmp_path, provider.get_tracer("test"))
    asyncio.run(flow.check(grpc_door, check_request("sk_live_a"), Call((("traceparent", TRACEPARENT),))))
    asyncio.run(flow.check(http_door, http_request("sk_live_b", traceparent=TRACEPARENT), Connection()))
    spans = [s for s in exporter.get_finished_spans() if s.name == "extauthz.check"]
    assert [(s.attributes or {}).get("rpc.system", (s.attributes or {}).get("extauthz.protocol"))
            for s in spans] == ["grpc", "http"]
    for span in spans:
        assert span.kind is SpanKind.SERVER
        assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7
