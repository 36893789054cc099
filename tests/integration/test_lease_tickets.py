"""Forged access-log entries change nothing in a real Redis and are counted; genuine
releases still free their slots, in one store round trip each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.engine.tickets import LeaseTickets
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc, auth_pb2, auth_pb2_grpc, core_pb2
from extauthz.server.app import Server, ServerConfig
from extauthz.store.keys import Keys
from testinfra.redis_servers import RedisSingle

pytestmark = pytest.mark.redis

POLICY = """version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: conc, type: concurrent_requests, limit: 1}
  - {name: fleet, type: fleet_usage, capacity: 100}
"""


def check_request(key: str) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    req.attributes.request.http.method = "GET"
    req.attributes.request.http.path = "/v1/x"
    req.attributes.request.http.headers["x-api-key"] = key
    return req


def metadata(leases: list[str], lease_id: str, ticket: str | None) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    # the one lease encoding (answers.lease_fields): header-shaped names, keys comma-separated
    md.update({LEASES_FIELD: ",".join(leases), LEASE_ID_FIELD: lease_id,
               **({LEASE_TICKET_FIELD: ticket} if ticket is not None else {})})
    return md


def log_message(*mds: struct_pb2.Struct) -> accesslog_pb2.StreamAccessLogsMessage:
    msg = accesslog_pb2.StreamAccessLogsMessage()
    for md in mds:
        entry = msg.http_logs.log_entry.add()
        entry.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].CopyFrom(md)
    return msg


def snapshot(redis: RedisSingle) -> dict[str, Any]:
    """Every key with its type and contents (sorted sets with scores)."""
    with redis.client() as c:
        out: dict[str, Any] = {}
        for key in sorted(c.scan_iter("*")):
            kind = c.type(key)
            out[key] = (kind, c.zrange(key, 0, -1, withscores=True) if kind == "zset"
                        else c.hgetall(key) if kind == "hash" else c.get(key) if kind == "string" else None)
        return out


def evalsha_calls(redis: RedisSingle) -> int:
    with redis.client() as c:
        return int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture
async def server(tmp_path: Path, redis_single_clean: RedisSingle) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              redis_url=redis_single_clean.url, store_deadline_ms=2000,
                              lease_secret="fleet-secret"))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


async def test_forged_entries_change_nothing_and_are_counted(server: Server, redis_single_clean: RedisSingle) -> None:
    redis = redis_single_clean
    with redis.client() as c:  # another application's data in the same database
        c.zadd("jobs:queue", {"job-42": 1.0})
        c.set("job-42", "payload")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        auth = auth_pb2_grpc.AuthorizationStub(ch)
        logs = accesslog_pb2_grpc.AccessLogServiceStub(ch)

        async def send(*mds: struct_pb2.Struct) -> None:
            async def stream():  # type: ignore[no-untyped-def]
                yield log_message(*mds)
            await logs.StreamAccessLogs(stream())

        alice = (await auth.Check(check_request("alice"))).dynamic_metadata
        bob = (await auth.Check(check_request("bob"))).dynamic_metadata
        assert (await auth.Check(check_request("alice"))).HasField("denied_response")  # limit 1 held
        a_keys = alice.fields[LEASES_FIELD].string_value.split(",")
        a_id, a_ticket = alice.fields[LEASE_ID_FIELD].string_value, alice.fields[LEASE_TICKET_FIELD].string_value
        b_keys = bob.fields[LEASES_FIELD].string_value.split(",")
        b_id, b_ticket = bob.fields[LEASE_ID_FIELD].string_value, bob.fields[LEASE_TICKET_FIELD].string_value
        assert len(a_ticket) == 32 and a_keys and all(server.engine.keys.is_lease_key(k) for k in a_keys)

        before, calls = snapshot(redis), evalsha_calls(redis)
        other_fleet = LeaseTickets(Keys("extauthz"), "another-fleet")
        await send(
            metadata(["jobs:queue"], "job-42", None),                        # the example
            metadata(["jobs:queue"], "0123456789abcdef", "0" * 32),         # foreign key, any ticket
            metadata([*a_keys, "job-42"], a_id, a_ticket),                   # a foreign key smuggled in
            metadata(a_keys, a_id, "0" * 32),                                # another user's lease, wrong ticket
            metadata(a_keys, a_id, None),                                    # no ticket
            metadata(a_keys, b_id, b_ticket),                                # bob's ticket replayed on alice's keys
            metadata(b_keys, a_id, a_ticket),                                # alice's ticket on bob's keys
            metadata(a_keys[:1], a_id, a_ticket),                            # altered: a key dropped
            metadata(a_keys, a_id, other_fleet.make(a_id, a_keys)),          # another secret's ticket
        )
        assert server.accesslog.rejected == {"malformed": 1, "foreign_key": 2, "bad_ticket": 5, "no_ticket": 1}
        assert server.panel.status()["access_log"]["rejected"] == server.accesslog.rejected
        assert server.engine.releaser.leases_released == 0
        assert evalsha_calls(redis) == calls  # not one store call for any of them
        assert snapshot(redis) == before      # every key exactly as it was
        with redis.client() as c:
            assert c.zrange("jobs:queue", 0, -1) == ["job-42"] and c.get("job-42") == "payload"
        assert (await auth.Check(check_request("alice"))).HasField("denied_response")  # still held

        # genuine entries still free their slots: one store round trip each
        calls = evalsha_calls(redis)
        await send(alice)
        for _ in range(100):
            if server.engine.releaser.leases_released:
                break
            await asyncio.sleep(0.01)
        assert server.engine.releaser.leases_released == len(a_keys)
        assert evalsha_calls(redis) == calls + 1
        assert (await auth.Check(check_request("alice"))).HasField("ok_response")  # holds the slot again
        # The genuine entry replayed (a recorded access-log message sent again) carries a valid
        # ticket but names the old lease id: it must not free alice's new lease.
        released = server.engine.releaser.leases_released
        await send(alice)
        for _ in range(100):
            if server.engine.releaser.count("access_log", "none"):
                break
            await asyncio.sleep(0.01)
        assert server.engine.releaser.count("access_log", "none") == 1
        assert server.engine.releaser.leases_released == released
        assert (await auth.Check(check_request("alice"))).HasField("denied_response")  # still held
        await send(bob)
        for _ in range(100):
            if server.engine.releaser.leases_released > len(a_keys):
                break
            await asyncio.sleep(0.01)
        assert (await auth.Check(check_request("bob"))).HasField("ok_response")
    assert set(server.accesslog.rejected) <= {"malformed", "foreign_key", "no_ticket", "bad_ticket"}


async def test_a_malformed_lease_entry_never_reaches_the_request_id_index(server: Server) -> None:
    """An entry carrying our lease fields in a shape no check writes (here a number) is not
    Envoy's: it is refused as malformed, and its request id does not free the lease the
    index holds for that id (which a genuine entry without metadata still frees)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        auth = auth_pb2_grpc.AuthorizationStub(ch)
        logs = accesslog_pb2_grpc.AccessLogServiceStub(ch)

        async def send(md: struct_pb2.Struct | None) -> None:
            msg = accesslog_pb2.StreamAccessLogsMessage()
            entry = msg.http_logs.log_entry.add()
            entry.request.request_id = "rid-carol"
            entry.request.request_method, entry.request.path = core_pb2.GET, "/v1/x?page=2"  # as checked
            if md is not None:
                entry.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].CopyFrom(md)

            async def stream():  # type: ignore[no-untyped-def]
                yield msg
            await logs.StreamAccessLogs(stream())

        req = check_request("carol")
        req.attributes.request.http.headers["x-request-id"] = "rid-carol"
        assert (await auth.Check(req)).HasField("ok_response")
        assert (await auth.Check(check_request("carol"))).HasField("denied_response")  # limit 1 held
        forged = struct_pb2.Struct()
        forged.update({LEASE_ID_FIELD: 7, LEASES_FIELD: "x"})
        await send(forged)
        assert server.accesslog.rejected == {"malformed": 1}
        assert server.engine.releaser.count("request_id_index") == 0
        assert (await auth.Check(check_request("carol"))).HasField("denied_response")  # still held

        await send(None)  # Envoy dropped our metadata: the index frees the lease
        for _ in range(100):
            if server.engine.releaser.leases_released:
                break
            await asyncio.sleep(0.01)
        assert server.engine.releaser.count("request_id_index") == 1
        assert (await auth.Check(check_request("carol"))).HasField("ok_response")


async def test_replicas_sharing_a_secret_accept_each_others_tickets(tmp_path: Path,
                                                                     redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    servers = [Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                                   redis_url=redis_single_clean.url, store_deadline_ms=2000, lease_secret=s))
               for s in ("shared", "shared", "different")]
    for s in servers:
        await s.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as ch:
            md = (await auth_pb2_grpc.AuthorizationStub(ch).Check(check_request("carol"))).dynamic_metadata
        for s, expect_rejected in ((servers[2], {"bad_ticket": 1}), (servers[1], {})):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
                async def stream():  # type: ignore[no-untyped-def]
                    yield log_message(md)
                await accesslog_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(stream())
            assert s.accesslog.rejected == expect_rejected
        assert servers[1].engine.releaser.leases_released == 2  # the replica sharing the secret released it
    finally:
        for s in servers:
            await s.stop(grace=0)
