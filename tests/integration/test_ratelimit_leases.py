"""ShouldRateLimit with the limiters that hold leases (concurrent_requests, fleet_usage) on a
real Redis, both gRPC servers: the descriptors' leases under one lease id in the response's
dynamic metadata (with its ticket), given back at once when the answer refuses the request,
and released by an access-log entry that carries them under the ratelimit filter's namespace."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE, RATELIMIT_NAMESPACE
from extauthz.proto import accesslog_pb2, accesslog_pb2_grpc, ratelimit_common_pb2, rls_pb2, rls_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from testinfra.redis_servers import RedisSingle

from ..conftest import FIXTURES

#: the lease limiters and a plain quota (shared with the e2e access-log test)
POLICY = FIXTURES / "policies" / "ratelimit_leases.yaml"
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT


@pytest.fixture(params=["grpcio", "asyncio"])
async def server(request: pytest.FixtureRequest, redis_single_clean: RedisSingle) -> AsyncIterator[Server]:
    srv = Server(ServerConfig(policies=[str(POLICY)], listen="127.0.0.1:0", admin_listen="off", reload_interval=0,
                              identity_salt="s", redis_url=redis_single_clean.url, store_deadline_ms=2000,
                              grpc_server=request.param))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=0)


def ask(*descriptors: dict[str, str]) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[
        ratelimit_common_pb2.RateLimitDescriptor(entries=[
            ratelimit_common_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in d.items()])
        for d in descriptors])


async def in_flight(srv: Server) -> list[int]:
    fleet = next(lim for lim, _ in srv.engine.snapshot.active if lim.name == "fleet")
    return list(await srv.engine.store.inflight((fleet.critical_key, fleet.other_key)))


async def test_leases_in_the_answer_released_by_the_access_log(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        rls = rls_pb2_grpc.RateLimitServiceStub(ch)
        first = await rls.ShouldRateLimit(ask({"api_key": "k1"}, {"tier": "critical"}, {"remote_address": "10.0.0.1"}))
        assert first.overall_code == OK
        md = dict(first.dynamic_metadata)
        keys = md[LEASES_FIELD].split(",")
        # the concurrency slot and the fleet's critical slot, one lease id, a ticket over both
        assert len(keys) == 2 and md[LEASE_ID_FIELD] and md[LEASE_TICKET_FIELD]
        assert await in_flight(server) == [1, 0]
        # k1 is in flight: refused; the fleet slot its tier descriptor took is given back at once
        second = await rls.ShouldRateLimit(ask({"api_key": "k1"}, {"tier": "post"}))
        assert (second.overall_code, [s.code for s in second.statuses]) == (OVER, [OVER, OK])
        assert not second.dynamic_metadata.fields
        assert await in_flight(server) == [1, 0]
        # a descriptor without leases: no metadata
        assert not (await rls.ShouldRateLimit(ask({"remote_address": "10.0.0.1"}))).dynamic_metadata.fields

        # the request finished: Envoy's access log hands the ratelimit filter's metadata back
        # (beside an ext_authz namespace of the team's own auth service, without our fields)
        msg = accesslog_pb2.StreamAccessLogsMessage()
        entry = msg.http_logs.log_entry.add()
        entry.common_properties.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE].update({"team": "auth"})
        entry.common_properties.metadata.filter_metadata[RATELIMIT_NAMESPACE].CopyFrom(first.dynamic_metadata)
        await accesslog_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(iter([msg]))
        assert await in_flight(server) == [0, 0]
        assert server.engine.releaser.counts[("access_log", "released")] == 1
        third = await rls.ShouldRateLimit(ask({"api_key": "k1"}, {"tier": "post"}))
        assert third.overall_code == OK and third.dynamic_metadata.fields
        assert await in_flight(server) == [0, 1]


async def test_an_altered_lease_list_releases_nothing(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        rls = rls_pb2_grpc.RateLimitServiceStub(ch)
        answer = await rls.ShouldRateLimit(ask({"api_key": "k1"}, {"tier": "post"}))
        msg = accesslog_pb2.StreamAccessLogsMessage()
        md = msg.http_logs.log_entry.add().common_properties.metadata.filter_metadata[RATELIMIT_NAMESPACE]
        md.CopyFrom(answer.dynamic_metadata)
        md.update({LEASES_FIELD: md[LEASES_FIELD].split(",")[0]})  # one key dropped: the ticket fails
        await accesslog_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(iter([msg]))
        assert await in_flight(server) == [0, 1]
        assert sum(server.accesslog.finished.rejected.values()) == 1
