"""The fluentd release port (server/fluentd.py) on a real socket, around a lease owner on the
embedded store: Forward-protocol messages however TCP splits them, the three modes, acks,
malformed input and the bounds (the connection closes, counted; nothing crashes), and the
same vetting and matching as the gRPC access log (server/leases.py FinishedEntries)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.envoy.records import FLUENTD_TAG as TAG
from extauthz.server.fluentd import FluentdLimits, FluentdReceiver, MalformedMessage, entries_of
from extauthz.server.leases import FinishedEntries, Leases, seen_as

from .helpers import engine_for, get, policy_from


class Admitted:
    """A lease owner on the embedded store (concurrent_requests, limit 2) and the fluentd port."""

    def __init__(self, tmp_path: Path, limits: FluentdLimits | None = None, fleet: bool = False) -> None:
        limiters: list[dict[str, Any]] = [
            {"name": "conc", "type": "concurrent_requests", "limit": 2, "lease_ttl": "60s"}]
        if fleet:
            limiters.append({"name": "fleet", "type": "fleet_usage", "capacity": 4, "reserved_for_critical": 0.5})
        policy = policy_from(tmp_path, {"limiters": limiters})
        self.engine, _ = engine_for(policy, ManualClock())
        self.leases = Leases(self.engine)
        self.finished = FinishedEntries(self.leases)
        self.receiver = FluentdReceiver(self.finished, limits)
        self.port = 0

    async def admit(self, request_id: str) -> dict[str, Any]:
        """Admit a check; the record Envoy would log for it."""
        ctx = self.engine.context(get(request_id=request_id))
        decision = await self.engine.decide(ctx)
        assert decision.allowed and decision.leases
        ticket = self.leases.admitted(ctx, decision, seen_as("GET", "/v1/customers"))
        return {"request_id": request_id, "response_flags": "-", "method": "GET", "path": "/v1/customers",
                "start_us": "1795000000123456", "duration_ms": 3,
                "ext_authz": {LEASE_ID_FIELD: decision.lease_id, LEASES_FIELD: ",".join(decision.leases),
                              LEASE_TICKET_FIELD: ticket}}

    def released(self) -> int:
        return self.leases.releaser.count("access_log", "released")

    async def send(self, *chunks: bytes, read_ack: bool = False) -> bytes:
        """Send ``chunks`` on one connection; what came back (read until the port closes it or,
        ``read_ack``, one ack arrives)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        got = b""
        if read_ack:
            got = await asyncio.wait_for(reader.read(1024), 10)
        writer.write_eof()
        got += await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return got


@pytest.fixture
async def port(tmp_path: Path) -> AsyncIterator[Admitted]:
    a = Admitted(tmp_path)
    a.port = await a.receiver.start("127.0.0.1:0")
    yield a
    await a.receiver.stop()


async def settle(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)


async def test_a_forward_message_split_anywhere_releases_every_lease(port: Admitted) -> None:
    records = [await port.admit(f"rid-{i}") for i in range(2)]
    stream = msgpack.packb([TAG, [[1795000000, r] for r in records]])
    await port.send(*(stream[i:i + 7] for i in range(0, len(stream), 7)))
    await settle(lambda: port.released() == 2)
    assert port.released() == 2 and len(port.leases.index) == 0
    assert port.finished.entries == 2 and port.receiver.status()["malformed"] == {}
    assert (await port.engine.decide(port.engine.context(get(request_id="again")))).allowed  # slots free


async def test_message_and_packed_forward_modes(port: Admitted) -> None:
    one, two = await port.admit("a"), await port.admit("b")
    packed = msgpack.packb([1795000000, two])
    await port.send(msgpack.packb([TAG, 1795000000, one]) + msgpack.packb([TAG, packed]))
    await settle(lambda: port.released() == 2)
    assert port.released() == 2 and port.receiver.messages == 2


async def test_a_chunk_option_is_acked(port: Admitted) -> None:
    record = await port.admit("a")
    got = await port.send(msgpack.packb([TAG, [[1, record]], {"chunk": "c2Vx", "size": 1}]), read_ack=True)
    assert msgpack.unpackb(got) == {"ack": "c2Vx"}
    assert port.receiver.acks == 1 and port.released() == 1


async def test_a_forged_ticket_releases_nothing_and_is_counted(port: Admitted) -> None:
    record = await port.admit("a")
    record["ext_authz"][LEASE_TICKET_FIELD] = "v1." + "00" * 32
    await port.send(msgpack.packb([TAG, [[1, record]]]))
    await settle(lambda: port.finished.rejected)
    assert port.finished.rejected == {"bad_ticket": 1} and port.released() == 0
    assert len(port.leases.index) == 1  # not even the request-id index acted on it


async def test_without_metadata_only_the_request_the_check_saw_and_never_a_refused_one(port: Admitted) -> None:
    record = await port.admit("a")
    del record["ext_authz"]
    refused = dict(record, response_flags="UAEX")
    other = dict(record, path="/elsewhere", start_us="1")
    await port.send(msgpack.packb([TAG, [[1, refused], [1, other]]]))
    await port.send(msgpack.packb([TAG, [[1, record]]]))
    await settle(lambda: port.leases.releaser.count("request_id_index", "released") == 1)
    assert port.leases.releaser.count("request_id_index", "released") == 1 and port.finished.entries == 3


async def test_requests_envoy_let_through_unchecked_are_counted_by_tier(port: Admitted) -> None:
    checked = await port.admit("a")  # a decision of ours: never counted, header or not
    base = {"request_id": "u", "response_flags": "-", "start_us": "1", "duration_ms": 3,
            "path": "/v1/customers", "authority": "api.example"}
    unchecked = [dict(base, method="GET", failure_mode_allowed="true"),
                 dict(base, method="POST", failure_mode_allowed="true"),
                 dict(base, method="-", path="-", failure_mode_allowed="true")]  # shows no request
    plain = dict(base, method="GET", failure_mode_allowed="-")  # checked, nothing to release
    forged = dict(checked, failure_mode_allowed="true")
    refused = dict(base, method="GET", failure_mode_allowed="true", response_flags="UAEX")  # we refused it
    await port.send(msgpack.packb([TAG, [[1, r] for r in (*unchecked, plain, forged, refused)]]))
    await settle(lambda: port.finished.entries == 6)
    assert port.finished.unchecked == {"get": 1, "post": 1, "unknown": 1}


async def test_an_entry_in_flight_releases_nothing_and_an_unchecked_one_is_counted_by_the_fleet(
        tmp_path: Path) -> None:
    a = Admitted(tmp_path, fleet=True)
    a.port = await a.receiver.start("127.0.0.1:0")
    try:
        record = await a.admit("a")
        await a.send(msgpack.packb([TAG, [[1, dict(record, log_type="DownstreamPeriodic")]]]))
        await settle(lambda: a.finished.entries == 1)
        assert a.released() == 0  # still in flight: its lease stays
        base = {"request_id": "u", "response_flags": "-", "method": "GET", "path": "/v1/customers",
                "failure_mode_allowed": "true"}
        await a.send(msgpack.packb([TAG, [[1, dict(base, log_type="DownstreamStart", failure_mode_allowed="-")],
                                          [1, dict(base, log_type="DownstreamPeriodic")],
                                          [1, dict(base, log_type="DownstreamPeriodic")]]]))
        await settle(lambda: a.finished.unchecked_counted == 1)
        fleet = a.engine.snapshot.limiters[1]
        assert a.finished.unchecked_counted == 1 and a.finished.unchecked == {}  # counted once, in flight
        assert await a.engine.store.inflight(list(fleet.lease_keys)) == [0, 2]  # the check's and the unchecked
        await a.send(msgpack.packb([TAG, [[1, dict(base, log_type="DownstreamEnd")]]]))
        await settle(lambda: a.finished.unchecked == {"get": 1})
        assert await a.engine.store.inflight(list(fleet.lease_keys)) == [0, 1]  # its slot given back
    finally:
        await a.receiver.stop()


def fleet_entries(tmp_path: Path, clock: ManualClock) -> tuple[FinishedEntries, Any]:
    """A server's finished-entry handler around a fleet limiter (lease_ttl 10 s) on the embedded
    store at ``clock``; and the limiter."""
    policy = policy_from(tmp_path, {"limiters": [{"name": "fleet", "type": "fleet_usage", "capacity": 4,
                                                  "reserved_for_critical": 0.5, "lease_ttl": "10s"}]})
    engine, _ = engine_for(policy, clock)
    return FinishedEntries(Leases(engine)), engine.snapshot.limiters[0]


async def periodic(finished: FinishedEntries, request_id: str = "u") -> None:
    """An unchecked request's periodic entry (the fail-open header, no metadata of ours)."""
    task = finished.in_flight(request_id, None, failed_open=True, request=lambda: get(key=""))
    if task is not None:
        await task


async def test_an_unchecked_request_longer_than_the_lease_ttl_stays_counted_and_a_lost_one_expires(
        tmp_path: Path) -> None:
    """Issue 29 review: the lease was taken once and later periodic entries ignored, so a
    request in flight longer than lease_ttl left the fleet's count; and an entry whose last
    entry never came (Envoy restarted) stayed in /status's in_flight until the bound evicted it."""
    from extauthz.engine.state import UncheckedPart

    clock = ManualClock()
    finished, fleet = fleet_entries(tmp_path, clock)
    store = finished.leases.engine.store
    in_flight = lambda: UncheckedPart(finished).status()["unchecked_requests"]["fleet"]["in_flight"]  # noqa: E731
    for _ in range(25):  # 25 s in flight, an entry a second (lease_ttl 10 s)
        await periodic(finished)
        clock.advance(1.0)
    assert await store.inflight(list(fleet.lease_keys)) == [0, 1] and in_flight() == 1
    assert finished.unchecked_counted == 1  # one request, its lease renewed
    finished.entry("u", None, unauthorized=False, seen=lambda: (), failed_open=True, request=lambda: get(key=""))
    assert await store.inflight(list(fleet.lease_keys)) == [0, 0] and in_flight() == 0

    await periodic(finished, "lost")  # its last entry never comes
    clock.advance(9.9)
    assert in_flight() == 1
    clock.advance(0.2)  # past its lease's TTL: the store dropped it, so does the count
    assert in_flight() == 0 and await store.inflight(list(fleet.lease_keys)) == [0, 0]


async def test_an_unchecked_request_takes_no_slot_of_a_fleet_limiter_switched_off(tmp_path: Path) -> None:
    """Issue 29 review: the in-flight count read every limiter of the policy, so entries (a
    forged header behind a config that does not strip it) took slots of a limiter switched off,
    still held when it was switched on again."""
    from extauthz.control.switches import Switches
    from extauthz.core.verdict import Mode

    clock = ManualClock()
    finished, fleet = fleet_entries(tmp_path, clock)
    engine, store = finished.leases.engine, finished.leases.engine.store
    await periodic(finished, "a")
    engine.set_switches(Switches(limiters={"fleet": Mode.OFF}))
    await periodic(finished, "a")  # its slot goes back
    await periodic(finished, "b")  # takes none
    assert await store.inflight(list(fleet.lease_keys)) == [0, 0] and not finished.unchecked_held
    engine.set_switches(Switches())
    await periodic(finished, "b")  # still in flight: counted from now
    assert await store.inflight(list(fleet.lease_keys)) == [0, 1] and list(finished.unchecked_held) == ["b"]


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xc1" * 4, "msgpack"),  # 0xc1: never used in msgpack
    (msgpack.packb({"not": "an array"}), "shape"),
    (msgpack.packb([TAG, [[1, "not a map"]]]), "shape"),
    (msgpack.packb([TAG, [[1, {}]], "not a map"]), "shape"),
    (msgpack.packb([TAG, b"\x93\x01\x02\x03", {"compressed": "gzip"}]), "compressed"),
    (msgpack.packb([TAG, [[1, {}]] * 11]), "too_large"),  # max_entries 10
    (msgpack.packb([TAG, [[1, {"pad": "x" * 5000}]]]), "too_large"),  # max_message_bytes 4096
])
async def test_malformed_input_closes_the_connection_and_is_counted(tmp_path: Path, data: bytes,
                                                                    reason: str) -> None:
    a = Admitted(tmp_path, FluentdLimits(max_message_bytes=4096, max_entries=10))
    a.port = await a.receiver.start("127.0.0.1:0")
    try:
        good = await a.admit("a")
        # a good message before the bad one is read; the connection then closes (read() ends)
        await a.send(msgpack.packb([TAG, [[1, good]]]) + data + msgpack.packb([TAG, [[1, good]]]))
        assert a.receiver.malformed == {reason: 1}
        assert a.receiver.messages == 1 and a.released() == 1
        await settle(lambda: not a.receiver.connections)
        # the port still serves
        await a.send(msgpack.packb([TAG, [[1, await a.admit("b")]]]))
        await settle(lambda: a.released() == 2)
        assert a.released() == 2
    finally:
        await a.receiver.stop()


async def test_connections_beyond_the_bound_are_closed(tmp_path: Path) -> None:
    a = Admitted(tmp_path, FluentdLimits(max_connections=1))
    a.port = await a.receiver.start("127.0.0.1:0")
    try:
        _, held = await asyncio.open_connection("127.0.0.1", a.port)
        await settle(lambda: len(a.receiver.connections) == 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the port
        writer.close()
        held.close()
        assert a.receiver.malformed == {"too_many_connections": 1}
    finally:
        await a.receiver.stop()


def test_entries_of_reads_the_three_modes_and_refuses_other_shapes() -> None:
    limits = FluentdLimits()
    rec = {"request_id": "r"}
    assert entries_of([TAG, [[1, rec]]], limits) == ([(1, rec)], None)
    assert entries_of([TAG, 1, rec, {"chunk": "x"}], limits) == ([(1, rec)], {"chunk": "x"})
    assert entries_of([TAG, msgpack.packb([1, rec]) * 2], limits) == ([(1, rec), (1, rec)], None)
    for bad in ([TAG], [1, []], [TAG, 1], [TAG, [[1]]], [TAG, [], {}, {}], "x"):
        with pytest.raises(MalformedMessage):
            entries_of(bad, limits)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FluentdLimits(max_entries=0)


class _StuckReleases(FinishedEntries):
    """Releases that never end (a store that stopped answering): each entry's task waits."""

    def __init__(self, leases: Leases) -> None:
        super().__init__(leases)
        self.stuck: list[asyncio.Future[int]] = []

    def entry(self, *args: Any, **kwargs: Any) -> asyncio.Task[int] | None:
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stuck.append(never)
        return asyncio.ensure_future(never)  # type: ignore[return-value]


async def test_a_stop_waits_for_releases_within_its_timeout_only(tmp_path: Path) -> None:
    """A graceful stop passes what is left of its budget (server/app.py stop_budget): a release
    that never ends does not hold the stop past it (Kubernetes would kill the pod first)."""
    a = Admitted(tmp_path)
    stuck = _StuckReleases(a.leases)
    a.receiver = FluentdReceiver(stuck)
    a.port = await a.receiver.start("127.0.0.1:0")
    record = await a.admit("rid-stuck")
    _, writer = await asyncio.open_connection("127.0.0.1", a.port)
    writer.write(msgpack.packb([TAG, [[1795000000, record]]]))
    await writer.drain()
    await settle(lambda: len(stuck.stuck) == 1)
    assert len(stuck.stuck) == 1 and a.receiver.status()["connections"] == 1
    # bounded by the test only so that a stop ignoring its timeout fails instead of hanging
    await asyncio.wait_for(a.receiver.stop(within=0.05), 60)
    assert not stuck.stuck[0].done()  # the stop returned with the release still running
    stuck.stuck[0].cancel()
    writer.close()
