"""Random CheckRequests (missing fields, huge or odd headers, unknown metadata shapes) and
random access-log messages: always an answer, never an unhandled exception, and the
server's per-request bookkeeping stays bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extauthz.core.clock import ManualClock
from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.engine.tickets import REASONS, LeaseTickets
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
from extauthz.policy import load_policy
from extauthz.proto import accesslog_pb2, auth_pb2
from extauthz.server.edge import check_response, raw_request
from extauthz.server.flow import CheckFlow
from extauthz.server.leases import LeaseIndex, Leases
from extauthz.server.services import AccessLogService, AuthorizationService
from extauthz.store.memory import MemoryStore

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
JWT = "envoy.filters.http.jwt_authn"
POLICY = f"""version: 1
identity:
  - metadata: {{namespace: {JWT}, path: [payload, sub]}}
  - principal: true
  - header: x-api-key
  - header: authorization
    strip_prefix: "Bearer "
  - source_ip: true
test_mode:
  key_prefix: sk_test_
  header: x-test-mode
  metadata: {{namespace: {JWT}, path: [payload, livemode], equals: false}}
classification:
  rules:
    - match: {{methods: [POST], path_prefix: /v1/charges, headers: {{x-kind: a}}}}
      tier: critical
limiters:
  - {{name: rate, type: request_rate, rate: 1000, burst: 1000}}
  - {{name: conc, type: concurrent_requests, limit: 1000}}
  - {{name: fleet, type: fleet_usage, capacity: 100000}}
"""

odd_text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "Bearer ", "bearer x", "sk_test_1", "\x00",
                                                            "é" * 3, "a" * 10_000, "true", "TRUE"]))
header_names = st.one_of(st.sampled_from(["x-api-key", "authorization", "x-test-mode", "x-request-id",
                                          "x-kind", ":path", "host"]), st.text(max_size=12))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.integers(-(2**60), 2**60), odd_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.sampled_from(["payload", "sub", "livemode"]),
                                                      st.text(max_size=6)), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def check_requests(draw: st.DrawFn) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    attrs = req.attributes
    if draw(st.booleans()):
        http = attrs.request.http
        http.method = draw(st.one_of(st.sampled_from(["GET", "post", "HEAD", "", "BREW"]), st.text(max_size=8)))
        http.path = draw(st.one_of(st.sampled_from(["/v1/charges", "/v1/charges?x=1", "?", ""]), odd_text))
        http.host = draw(odd_text)
        http.headers.update(draw(st.dictionaries(header_names, odd_text, max_size=8)))
    if draw(st.booleans()):
        attrs.source.principal = draw(odd_text)
        attrs.source.address.socket_address.address = draw(odd_text)
    for _ in range(draw(st.integers(0, 2))):
        ns = draw(st.one_of(st.just(JWT), st.just("extauthz"), st.text(max_size=10)))
        value = draw(json_values)
        target = attrs.metadata_context if draw(st.booleans()) else attrs.route_metadata_context
        try:
            target.filter_metadata[ns].update({"payload": value, "tier": value})
        except (ValueError, TypeError):  # values a Struct cannot hold (e.g. huge ints)
            pass
    if draw(st.booleans()):
        attrs.context_extensions.update(draw(st.dictionaries(st.text(max_size=6), odd_text, max_size=3)))
    return req


class _Context:
    def add_done_callback(self, callback: Any) -> None:
        pass


@pytest.fixture
def services(tmp_path: Path) -> Iterator[tuple[AuthorizationService, AccessLogService]]:
    f = tmp_path / "p.yaml"
    f.write_text(POLICY)
    engine = Engine(StoreGate(MemoryStore(ManualClock()), clock=ManualClock()), load_policy([f]))
    index, tickets = LeaseIndex(limit=64), LeaseTickets(engine.keys, "fuzz")
    leases = Leases(engine, tickets=tickets, index=index)
    yield AuthorizationService(CheckFlow(engine, leases)), AccessLogService(leases)


@SETTINGS
@given(req=check_requests())
def test_random_check_requests_always_get_an_answer(services: tuple[AuthorizationService, AccessLogService],
                                                     req: auth_pb2.CheckRequest) -> None:
    auth, _ = services
    engine = auth.flow.engine
    snap = engine.snapshot
    # the edge itself never raises (the servicer's catch-all is for the unforeseen only)
    raw = raw_request(req, snap.classifier.needed_headers, snap.policy.needed_route_metadata,
                      snap.classifier.needed_metadata)
    ctx = snap.classifier.context(raw)
    assert len(ctx.identity) == 24
    resp = asyncio.run(auth.Check(req, _Context()))
    assert resp.HasField("ok_response") or resp.HasField("denied_response")
    assert auth.flow.bad_requests == 0
    check_response(ctx, asyncio.run(engine.decide(ctx))).SerializeToString()
    index = auth.flow.leases.index
    assert len(index) <= index.limit


def _struct(value: Any) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    try:
        md.update(value if isinstance(value, dict) else {"leases": value})
    except (ValueError, TypeError):
        pass
    return md


@st.composite
def log_messages(draw: st.DrawFn) -> accesslog_pb2.StreamAccessLogsMessage:
    msg = accesslog_pb2.StreamAccessLogsMessage()
    for _ in range(draw(st.integers(0, 4))):
        entry = msg.http_logs.log_entry.add()
        entry.request.request_id = draw(st.one_of(st.just(""), st.sampled_from(["r1", "r2"]), st.text(max_size=8)))
        common = entry.common_properties
        common.intermediate_log_entry = draw(st.booleans())
        if draw(st.booleans()):
            common.response_flags.unauthorized_details.reason = 1
        shape = draw(st.one_of(
            json_values,
            st.fixed_dictionaries({LEASE_ID_FIELD: st.one_of(st.text(max_size=20), st.just("0123456789abcdef")),
                                   LEASES_FIELD: st.lists(st.one_of(st.text(max_size=30), st.sampled_from(
                                       ["jobs:queue", "extauthz:{fleet}:fl:fleet:other"])), max_size=40).map(",".join)},
                                  optional={LEASE_TICKET_FIELD: st.one_of(st.text(max_size=40), json_values)}),
        ))
        ns = draw(st.one_of(st.just(EXT_AUTHZ_NAMESPACE), st.text(max_size=8)))
        common.metadata.filter_metadata[ns].CopyFrom(_struct(shape))
    return msg


@SETTINGS
@given(messages=st.lists(log_messages(), max_size=5))
def test_random_access_log_messages_never_break_the_stream(
        services: tuple[AuthorizationService, AccessLogService],
        messages: list[accesslog_pb2.StreamAccessLogsMessage]) -> None:
    _, logs = services

    async def stream() -> AsyncIterator[accesslog_pb2.StreamAccessLogsMessage]:
        for m in messages:
            yield m

    asyncio.run(logs.StreamAccessLogs(stream(), _Context()))
    assert set(logs.rejected) <= set(REASONS)
    assert logs.leases.releaser.leases_released == 0  # nothing forged was ever released


def test_bookkeeping_stays_bounded_after_many_requests(services: tuple[AuthorizationService, AccessLogService]) -> None:
    auth, _ = services

    async def run() -> None:
        for i in range(500):
            req = auth_pb2.CheckRequest()
            req.attributes.request.http.method = "GET"
            req.attributes.request.http.headers.update({"x-api-key": f"k{i % 7}", "x-request-id": f"rid-{i}"})
            assert (await auth.Check(req, _Context())).HasField("ok_response")

    asyncio.run(run())
    index = auth.flow.leases.index
    assert len(index) == index.limit == 64  # the oldest request ids were forgotten
