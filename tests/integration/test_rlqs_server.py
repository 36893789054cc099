"""StreamRateLimitQuotas on the gRPC port, both servers (asyncio and grpcio), with grpcio's
client as Envoy's stand-in: a first report is assigned a token bucket of the limiter's numbers;
a second stream on the same bucket shrinks the first (pushed to it at once); /status lists the
streams and buckets; a bad report ends the stream with INVALID_ARGUMENT. The real Envoy's side:
docs/rlqs.md (what was verified) and the e2e test of the next session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from extauthz.proto import ratelimit_strategy_pb2, rlqs_pb2, rlqs_pb2_grpc
from extauthz.server.app import Server, ServerConfig
from extauthz.server.services import quota_metrics

WAIT = 10.0
BUCKET = {"limiter": "per-ip", "ip": "10.0.0.7"}


@pytest.fixture(params=["asyncio", "grpcio"])
async def server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: per-ip, type: request_rate, rate: 10, burst: 20, key: [{source_ip: true}],\n"
                      "     enforce: envoy}\n")
    srv = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:0", admin_listen="off",
                              grpc_server=request.param))
    await srv.start()
    yield srv
    await srv.stop(grace=0)


def _report(domain: str = "", elapsed: int = 0, allowed: int = 0, denied: int = 0,
            bucket: dict[str, str] = BUCKET) -> rlqs_pb2.RateLimitQuotaUsageReports:
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain=domain)
    usage = msg.bucket_quota_usages.add()
    usage.bucket_id.bucket.update(bucket)
    usage.time_elapsed.seconds = elapsed
    usage.num_requests_allowed, usage.num_requests_denied = allowed, denied
    return msg


def _bucket(response: rlqs_pb2.RateLimitQuotaResponse) -> tuple[int, int, int, float]:
    (action,) = response.bucket_action
    assert dict(action.bucket_id.bucket) == BUCKET
    assign = action.quota_assignment_action
    tb = assign.rate_limit_strategy.token_bucket
    return (tb.max_tokens, tb.tokens_per_fill.value, tb.fill_interval.seconds,
            assign.assignment_time_to_live.ToNanoseconds() / 1e9)


async def _read(call: Any) -> rlqs_pb2.RateLimitQuotaResponse:
    message = await asyncio.wait_for(call.read(), WAIT)
    assert message is not grpc.aio.EOF
    return message  # type: ignore[no-any-return]


async def test_streams_divide_one_limit(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch)
        first = stub.StreamRateLimitQuotas()
        await first.write(_report("edge"))
        assert _bucket(await _read(first)) == (20, 10, 1, 15.0)
        second = stub.StreamRateLimitQuotas()
        await second.write(_report("edge"))
        # the second waits for the first's confirmed shrink (an empty share: DENY_ALL); the
        # first is told to shrink now
        (waiting,) = (await _read(second)).bucket_action
        assert (waiting.quota_assignment_action.rate_limit_strategy.blanket_rule
                == ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL)
        burst, fill, _, _ = _bucket(await _read(first))
        assert (burst, fill) == (10, 5)
        status = server.panel.status()["quota"]
        assert [len(s["buckets"]) for s in status["streams"]] == [1, 1]
        assert status["overadmission"] == 0
        families = {m.name: m.samples for m in quota_metrics(server.quota.book)}
        assert families["extauthz_quota_streams"][0].value == 2
        assert families["extauthz_quota_overadmission"][0].value == 0
        assert families["extauthz_quota_reported_excess"][0].value == status["reported_excess"] == 0
        assert families["extauthz_quota_coalesced"][0].value == status["coalesced"]
        await first.done_writing()
        await second.done_writing()
        assert await asyncio.wait_for(first.code(), WAIT) == grpc.StatusCode.OK


async def test_unknown_limiter_denied_and_bad_report_ends_the_stream(server: Server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch).StreamRateLimitQuotas()
        await call.write(_report("edge", bucket={"limiter": "nope"}))
        (action,) = (await _read(call)).bucket_action
        assert (action.quota_assignment_action.rate_limit_strategy.blanket_rule
                == ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL)
        await call.write(_report(bucket={"limiter": "x" * 600}))
        assert await asyncio.wait_for(call.code(), WAIT) == grpc.StatusCode.INVALID_ARGUMENT
        assert "bytes" in await call.details()
