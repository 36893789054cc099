"""The quota stream's adapter (server/services.py RateLimitQuotaService) against a peer that
sends reports and never reads the answers: the answers waiting for it are bounded in bytes,
not only in count (256 answers of 1000 buckets each were about 140 MB), and the stream ends
with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from extauthz.clock import ManualClock
from extauthz.proto import rlqs_pb2
from extauthz.quota_service import QuotaBook, QuotaLimit
from extauthz.server.services import MAX_QUOTA_OUTBOX_BYTES, RateLimitQuotaService

BUCKETS = 1000


class _Aborted(Exception):
    pass


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _report(domain: str = "") -> rlqs_pb2.RateLimitQuotaUsageReports:
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain=domain)
    for i in range(BUCKETS):
        usage = msg.bucket_quota_usages.add()
        usage.bucket_id.bucket.update({"limiter": "per-ip", "header:x-tenant": f"{i:08d}" + "t" * 460})
    return msg


async def test_answers_not_read_are_bounded_in_bytes() -> None:
    book = QuotaBook(lambda: {"per-ip": QuotaLimit(10, 20)}, clock=ManualClock())
    service = RateLimitQuotaService(book)
    sent = 0
    hold = asyncio.Event()

    async def reports() -> AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        nonlocal sent
        for n in range(40):
            sent += 1
            yield _report("edge" if n == 0 else "")
        await hold.wait()  # the peer keeps its stream open

    answers = service.StreamRateLimitQuotas(reports(), _Context())
    first = await answers.__anext__()  # then the peer stops reading
    assert len(first.bucket_action) == BUCKETS
    size = first.ByteSize()
    for _ in range(500):
        if book.refused.get("outbox") or sent == 40:
            break
        await asyncio.sleep(0.01)
    assert book.refused.get("outbox") == 1
    assert sent < 40  # ended long before 256 answers
    (sid,) = service.queued
    assert service.queued[sid] <= MAX_QUOTA_OUTBOX_BYTES + size
    hold.set()
    await answers.aclose()
    assert not service.queued and not service.outboxes
