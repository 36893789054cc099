"""The quota stream's adapter (server/services.py RateLimitQuotaService) against a peer that
sends reports and never reads the answers: the answers waiting for it are bounded in bytes,
not only in count (256 answers of 1000 buckets each were about 140 MB), and the stream ends
with RESOURCE_EXHAUSTED once the peer took nothing for ``answer_wait``; a burst of reports
from a peer that reads (a fresh Envoy reports each bucket at once) is answered, never ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import QuotaBook, QuotaLimit
from extauthz.proto import rlqs_pb2
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
    clock = ManualClock()
    book = QuotaBook(lambda: {"per-ip": QuotaLimit(10, 20)}, clock=clock)
    service = RateLimitQuotaService(book)
    service.answer_wait = 0.05  # how long the reader waits for the peer to take an answer
    sent = 0
    hold = asyncio.Event()

    async def reports() -> AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        nonlocal sent
        for n in range(40):
            sent += 1
            clock.advance(5.0)  # at Envoy's pace (sooner, a bucket's entries are coalesced)
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


class _Peer:
    """A peer's report stream fed by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[rlqs_pb2.RateLimitQuotaUsageReports | None] = asyncio.Queue()

    async def reports(self) -> AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        while (message := await self.queue.get()) is not None:
            yield message


def _one(domain: str = "", elapsed: int = 0, allowed: int = 0) -> rlqs_pb2.RateLimitQuotaUsageReports:
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain=domain)
    usage = msg.bucket_quota_usages.add()
    usage.bucket_id.bucket.update(BUCKET)
    usage.time_elapsed.seconds = elapsed
    usage.num_requests_allowed = allowed
    return msg


BUCKET = {"limiter": "per-ip", "source_ip": "10.0.0.7"}
KEY = tuple(sorted(BUCKET.items()))


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_shrink_not_taken_by_its_stream_is_never_confirmed() -> None:
    # a reads its first answer, then stops reading: the shrink b's subscription pushes to it
    # waits in its outbox. Its reports keep coming, and must not confirm a shrink it never took
    clock = ManualClock()
    book = QuotaBook(lambda: {"per-ip": QuotaLimit(10, 20)}, clock=clock, confirm_on_write=True)
    service = RateLimitQuotaService(book)
    a, b = _Peer(), _Peer()
    answers_a = service.StreamRateLimitQuotas(a.reports(), _Context())
    answers_b = service.StreamRateLimitQuotas(b.reports(), _Context())
    await a.queue.put(_one("edge"))
    first = await answers_a.__anext__()
    assert first.bucket_action[0].quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens == 20
    await b.queue.put(_one("edge"))
    await answers_b.__anext__()  # b: nothing yet (a holds it all)
    (stream_a,) = [s for s in book.streams.values() if s.peer and KEY in s.buckets and s.id == 1]
    held = stream_a.buckets[KEY]
    assert held.share.burst < 20 and held.until == float("inf")  # the shrink waits unwritten
    for _ in range(3):
        clock.advance(5)
        await a.queue.put(_one(elapsed=5, allowed=30))
        await _settle()
        assert held.ledger.burst == 20  # a's Envoy may still enforce 20: held
    shrink = await answers_a.__anext__()
    assert shrink.bucket_action[0].quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens < 20
    assert held.until == float("inf")  # handed out, not yet taken: the server waits for the next
    for _ in range(3):  # the answers to a's three reports
        await answers_a.__anext__()
    more = asyncio.ensure_future(answers_a.__anext__())  # a took them all: the connection asks for more
    await _settle()
    assert held.until == clock.monotonic() + 2.5
    clock.advance(5)
    await a.queue.put(_one(elapsed=5, allowed=30))
    await asyncio.wait_for(more, 5)
    assert held.ledger.burst < 20  # confirmed
    for peer, answers in ((a, answers_a), (b, answers_b)):
        await peer.queue.put(None)
        await answers.aclose()


async def test_a_burst_of_reports_from_a_peer_that_reads_is_answered_not_ended() -> None:
    # a fresh Envoy with 1,000 keys sends 1,000 one-bucket reports at once (bench harness row
    # (q-mem)): without a store ledger no report awaits, and the outbox passed its bound before
    # the writer ran once: the stream was ended and its buckets DENY_ALL on the next one
    book = QuotaBook(lambda: {"per-ip": QuotaLimit(10, 20)}, clock=ManualClock())
    service = RateLimitQuotaService(book)
    reports = 1000

    async def burst() -> AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        for i in range(reports):
            msg = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge" if i == 0 else "")
            usage = msg.bucket_quota_usages.add()
            usage.bucket_id.bucket.update({"limiter": "per-ip", "source_ip": f"10.0.{i // 256}.{i % 256}"})
            yield msg

    answers = [a async for a in service.StreamRateLimitQuotas(burst(), _Context())]
    assert len(answers) == reports
    assert not book.refused.get("outbox")
    assert all(len(a.bucket_action) == 1 for a in answers)
