"""The gRPC front door: the Authorization/Check, RateLimitService/ShouldRateLimit,
AccessLogService/StreamAccessLogs and RateLimitQuotaService/StreamRateLimitQuotas servicers.

Thin adapters: Check translates a CheckRequest for the check flow (``server/flow.py``) and
its decision into a CheckResponse (``server/edge.py``); ShouldRateLimit runs each descriptor
of a RateLimitRequest through the same flow (``server/rls.py``); StreamAccessLogs reads each entry's
lease metadata and request and hands them to the entry handling it shares with the fluentd
port (``server/leases.py`` :class:`~extauthz.server.leases.FinishedEntries`);
StreamRateLimitQuotas translates usage reports and bucket actions for the quota book
(``extauthz/engine/quota_service.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from functools import partial
from typing import Any

import grpc
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..core.context import RawRequest, RequestContext
from ..core.verdict import Decision
from ..engine.engine import Snapshot
from ..engine.quota_service import NOTHING, Action, BucketKey, QuotaBook, QuotaError, Share, Stream, Usage, bucket_key
from ..envoy.headers import FAILURE_MODE_HEADER
from ..envoy.records import LEASE_NAMESPACES, ROUTE_TIER_TAG
from ..proto import (
    accesslog_data_pb2,
    accesslog_pb2,
    accesslog_pb2_grpc,
    auth_pb2,
    auth_pb2_grpc,
    core_pb2,
    ratelimit_strategy_pb2,
    rlqs_pb2,
    rlqs_pb2_grpc,
    rls_pb2,
    rls_pb2_grpc,
)
from .edge import check_response, lease_metadata, raw_request
from .flow import CheckFlow
from .grpc_h2 import call_time_left
from .leases import (
    MAX_PENDING_RELEASES,
    FinishedEntries,
    Leases,
    seen_as,
    seen_at,
)
from .rls import RateLimitDoor

_RPC = {"rpc.system": "grpc", "rpc.service": "envoy.service.auth.v3.Authorization", "rpc.method": "Check"}


class AuthorizationService(auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    """Check: the gRPC front door of the check flow (a :class:`~extauthz.server.flow.Door`)."""

    name = "grpc"
    what = "a CheckRequest"
    span = _RPC

    def __init__(self, flow: CheckFlow) -> None:
        self.flow = flow

    async def Check(  # noqa: N802 - gRPC method name
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.CheckResponse:
        return await self.flow.check(self, request, context)

    # -- the Door: CheckRequest in, CheckResponse out
    def read(self, message: auth_pb2.CheckRequest, snap: Snapshot) -> RawRequest:
        return raw_request(message, snap.classifier.needed_headers, snap.policy.needed_route_metadata,
                           snap.classifier.needed_metadata)

    def hold(self, message: auth_pb2.CheckRequest, call: grpc.aio.ServicerContext,
             ctx: RequestContext, decision: Decision, leases: Leases) -> str:
        # Envoy may reset the call after we answer (client abort, ext_authz timeout): then
        # the answer, and the leases in it, never reach the access log.
        call.add_done_callback(lambda c: leases.abandoned(decision) if c.cancelled() else None)
        when = message.attributes.request.time  # Envoy's start of the downstream stream
        return (seen_at(when.seconds * 1_000_000 + when.nanos // 1000) if when.seconds
                else seen_as(ctx.method, ctx.path))

    def answer(self, message: auth_pb2.CheckRequest, ctx: RequestContext, decision: Decision,
               ticket: str) -> auth_pb2.CheckResponse:
        return check_response(ctx, decision, ticket)

    def time_left(self, message: auth_pb2.CheckRequest,
                  call: grpc.aio.ServicerContext) -> tuple[float | None, float, bool]:
        return call_time_left(call)

    def unreadable(self, message: auth_pb2.CheckRequest) -> auth_pb2.CheckResponse:
        return auth_pb2.CheckResponse(ok_response=auth_pb2.OkHttpResponse())

    def carrier(self, message: auth_pb2.CheckRequest,
                call: grpc.aio.ServicerContext) -> Iterable[tuple[str, Any]]:
        return call.invocation_metadata() or ()


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """ShouldRateLimit: Envoy's ratelimit filter's door to the check flow (one flow, engine,
    store and policy with Check)."""

    def __init__(self, flow: CheckFlow) -> None:
        self.door = RateLimitDoor(flow)

    async def ShouldRateLimit(  # noqa: N802 - gRPC method name
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        return await self.door.should_rate_limit(request, context)


def entry_leases(fm: Mapping[str, Any]) -> dict[str, str | None] | None:
    """The lease fields of an entry's filter metadata: the ext_authz namespace's (Check), else
    the ratelimit filter's (ShouldRateLimit), the first that holds any; None: neither is there."""
    found: dict[str, str | None] | None = None
    for namespace in LEASE_NAMESPACES:
        if namespace in fm:
            md = lease_metadata(fm[namespace])
            if md:
                return md
            if found is None:
                found = md
    return found


def entry_seen(entry: accesslog_data_pb2.HTTPAccessLogEntry) -> tuple[str, ...]:
    """What an access-log entry says of its request, in :meth:`LeaseIndex.take`'s terms."""
    start = entry.common_properties.start_time
    request = entry.request
    method = core_pb2.RequestMethod.Name(request.request_method)
    seen = [seen_at(start.seconds * 1_000_000 + start.nanos // 1000), seen_as(method, request.path)]
    if request.original_path:
        seen.append(seen_as(method, request.original_path))
    return tuple(seen)


def entry_request(entry: accesslog_data_pb2.HTTPAccessLogEntry) -> RawRequest:
    """What an access-log entry shows of its request for the classifier: method, path,
    authority, the request headers the access log was told to log (the tier rules' headers,
    ``extauthz envoy-config``) and the route's tier (custom tag :data:`ROUTE_TIER_TAG`)."""
    request = entry.request
    method = request.request_method
    return RawRequest(core_pb2.RequestMethod.Name(method) if method else "", request.path,
                      request.authority, dict(request.request_headers),
                      route_tier=entry.common_properties.custom_tags.get(ROUTE_TIER_TAG) or None)


def finished_after(common: accesslog_data_pb2.AccessLogCommon) -> float | None:
    """Seconds from the request's start to the last byte sent downstream, if Envoy says."""
    if not common.HasField("time_to_last_downstream_tx_byte"):
        return None
    d = common.time_to_last_downstream_tx_byte
    return float(d.seconds + d.nanos / 1e9)


class AccessLogService(accesslog_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """StreamAccessLogs: reads each finished request's entry for the entry handling both
    release receivers share (:class:`~extauthz.server.leases.FinishedEntries`), which vets
    it, matches it to its leases and hands them to the releaser."""

    def __init__(self, leases: Leases, *,
                 on_finished: Callable[[str, float | None], None] | None = None) -> None:
        self.leases = leases
        #: the entry handling, shared with the fluentd port (server/fluentd.py)
        self.finished = FinishedEntries(leases, on_finished=on_finished)

    @property
    def rejected(self) -> dict[str, int]:
        """Entries refused before any store call, by reason (both receivers)."""
        return self.finished.rejected

    @property
    def entries(self) -> int:
        """Entries read (both receivers)."""
        return self.finished.entries

    async def StreamAccessLogs(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[accesslog_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> accesslog_pb2.StreamAccessLogsResponse:
        # Releases run as tasks so that reading the stream never waits on the store: a
        # slow release must not hold back the entries behind it (their leases would
        # linger and inflate every in-flight count). At most MAX_PENDING at a time.
        finished = self.finished
        pending: set[asyncio.Future[Any]] = set()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    finished.entries += 1
                    common = entry.common_properties
                    fm = common.metadata.filter_metadata
                    md = entry_leases(fm)
                    failed_open = FAILURE_MODE_HEADER in entry.request.request_headers
                    task: asyncio.Future[Any] | None
                    if common.intermediate_log_entry:  # in flight (access_log_flush_interval)
                        task = finished.in_flight(entry.request.request_id, md, failed_open=failed_open,
                                                  request=partial(entry_request, entry))
                    else:
                        task = finished.entry(entry.request.request_id, md,
                                              unauthorized=common.response_flags.HasField("unauthorized_details"),
                                              seen=partial(entry_seen, entry),
                                              duration=partial(finished_after, common),
                                              failed_open=failed_open, request=partial(entry_request, entry))
                    if task is None:  # nothing to release, or done at once (embedded store)
                        continue
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    if len(pending) >= MAX_PENDING_RELEASES:
                        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        pending -= done
        finally:
            if pending:
                await asyncio.wait(pending)
        return accesslog_pb2.StreamAccessLogsResponse()


#: messages, and their bytes, a quota stream may have waiting to be written. Its own answers
#: past them hold its reader (no report of it is read until the connection took some: the
#: peer's own writes then wait on HTTP/2 flow control), for at most ANSWER_WAIT: then its
#: stream ends (it stopped reading); a shrink pushed to another stream
#: whose answers pile up past them ends that stream (it stopped reading; its holds stay in the
#: ledger until their TTL). One answer may pass the bytes alone (a report of 4096 buckets of
#: 512 bytes is answered in about 2.5 MB): memory per stream stays a few MB, not 256 answers
MAX_QUOTA_OUTBOX = 256
MAX_QUOTA_OUTBOX_BYTES = 4 << 20
#: seconds a stream's reader waits for room in its full outbox before it ends the stream
#: (two of Envoy 1.40's report intervals)
ANSWER_WAIT = 10.0


class RateLimitQuotaService(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):  # type: ignore[misc]
    """StreamRateLimitQuotas (RLQS, docs/rlqs.md): Envoy's usage reports in, bucket actions
    out, both ways at once. The quota logic is :class:`~extauthz.engine.quota_service.QuotaBook`;
    this adapter only translates: each report is one :meth:`QuotaBook.report`, whose actions
    (settled with the store's ledger, :meth:`QuotaBook.settle`) go to their streams (another
    stream's shrink pushed to it at once)."""

    def __init__(self, book: QuotaBook) -> None:
        self.book = book
        self.outboxes: dict[int, asyncio.Queue[rlqs_pb2.RateLimitQuotaResponse | None]] = {}
        #: bytes waiting in each outbox
        self.queued: dict[int, int] = {}
        #: set when a stream's writer took an answer out (its reader, held by a full outbox,
        #: reads on)
        self.room: dict[int, asyncio.Event] = {}
        #: how long a stream's reader waits for its full outbox to make room
        self.answer_wait = ANSWER_WAIT

    async def StreamRateLimitQuotas(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rlqs_pb2.RateLimitQuotaResponse]:
        try:
            stream = self.book.open(context.peer())
        except QuotaError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        box: asyncio.Queue[rlqs_pb2.RateLimitQuotaResponse | None] = asyncio.Queue()
        self.outboxes[stream.id] = box
        self.queued[stream.id] = 0
        room = self.room[stream.id] = asyncio.Event()
        reader = asyncio.create_task(self._read(stream, request_iterator, box), name="extauthz-rlqs-reader")
        try:
            while (message := await box.get()) is not None:
                self.queued[stream.id] -= message.ByteSize()
                room.set()
                yield message
                # taken by the connection: a shrink in it may now be confirmed by a report
                self.book.written(stream, _shares(message))
            problem = (reader.result() if reader.done()
                       else (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota answers are not read"))
        finally:
            reader.cancel()
            self.outboxes.pop(stream.id, None)
            self.queued.pop(stream.id, None)
            self.room.pop(stream.id, None)
            self.book.close(stream)
        if problem is not None:
            await context.abort(*problem)

    async def _read(self, stream: Stream, reports: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
                    box: asyncio.Queue[rlqs_pb2.RateLimitQuotaResponse | None]) -> tuple[grpc.StatusCode, str] | None:
        """Reads the stream's reports until it ends; the status to end it with, if not OK."""
        room = self.room[stream.id]
        try:
            async for message in reports:
                usages = [Usage(dict(u.bucket_id.bucket),
                                u.time_elapsed.seconds + u.time_elapsed.nanos / 1e9,
                                u.num_requests_allowed, u.num_requests_denied)
                          for u in message.bucket_quota_usages]
                try:
                    out = self.book.report(stream, message.domain, usages)
                except QuotaError as exc:
                    return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                out = await self.book.settle(out)  # as far as the store's ledger backs it
                for sid, actions in out.items():
                    target = self.outboxes.get(sid)
                    if target is None:
                        continue
                    answer = quota_response(actions)
                    size = answer.ByteSize()
                    if target is box:
                        # a burst of reports (a fresh Envoy reports each new bucket at once) is
                        # answered as fast as the connection takes the answers; a peer that
                        # took none for ANSWER_WAIT seconds stopped reading: its stream ends
                        while self._full(sid, size):
                            room.clear()
                            try:
                                await asyncio.wait_for(room.wait(), self.answer_wait)
                            except TimeoutError:
                                self.book.refused["outbox"] = self.book.refused.get("outbox", 0) + 1
                                return grpc.StatusCode.RESOURCE_EXHAUSTED, "quota answers are not read"
                    elif self._full(sid, size):
                        self.book.refused["outbox"] = self.book.refused.get("outbox", 0) + 1
                        target.put_nowait(None)  # that stream ends; its holds stay until their TTL
                        continue
                    self.queued[sid] += size
                    target.put_nowait(answer)
                # reports already read (one connection read may hold hundreds) yield the loop
                # between them, as the checks on other connections wait for it
                await asyncio.sleep(0)
            return None
        finally:
            box.put_nowait(None)


    def _full(self, sid: int, size: int) -> bool:
        """Whether stream ``sid``'s outbox has no room for an answer of ``size`` bytes."""
        box = self.outboxes[sid]
        waiting = box.qsize()
        return waiting >= MAX_QUOTA_OUTBOX or (waiting > 0 and self.queued[sid] + size > MAX_QUOTA_OUTBOX_BYTES)


def _shares(response: rlqs_pb2.RateLimitQuotaResponse) -> Iterable[tuple[BucketKey, Share]]:
    """The buckets an answer assigned and the share each carried (DENY_ALL: none)."""
    for item in response.bucket_action:
        if item.HasField("quota_assignment_action"):
            strategy = item.quota_assignment_action.rate_limit_strategy
            tb = strategy.token_bucket
            share = Share(tb.tokens_per_fill.value, tb.max_tokens) if strategy.HasField("token_bucket") else NOTHING
            yield bucket_key(item.bucket_id.bucket), share


def quota_response(actions: Iterable[Action]) -> rlqs_pb2.RateLimitQuotaResponse:
    """Bucket actions as Envoy 1.40 enforces them: a token bucket (``fill_interval`` whole
    seconds), a DENY_ALL blanket rule (no limiter, an empty share, a tier shed whole), an
    ALLOW_ALL one (a shedder's tier not shed whole), or an abandon; every assignment with its TTL."""
    response = rlqs_pb2.RateLimitQuotaResponse()
    for action in actions:
        item = response.bucket_action.add()
        item.bucket_id.bucket.update(dict(action.bucket))
        if action.share is None:
            item.abandon_action.SetInParent()
            continue
        assign = item.quota_assignment_action
        assign.assignment_time_to_live.FromNanoseconds(int(action.ttl * 1e9))
        strategy = assign.rate_limit_strategy
        if action.allow:  # a shedder's tier it does not refuse whole
            strategy.blanket_rule = ratelimit_strategy_pb2.RateLimitStrategy.ALLOW_ALL
            continue
        if action.deny or not (action.share.fill and action.share.burst):
            # an empty share is DENY_ALL: Envoy's TokenBucket takes max_tokens and
            # tokens_per_fill above 0 only
            strategy.blanket_rule = ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL
            continue
        bucket = strategy.token_bucket
        bucket.max_tokens = action.share.burst
        bucket.tokens_per_fill.value = action.share.fill
        bucket.fill_interval.seconds = action.interval
    return response


def quota_metrics(book: QuotaBook) -> Iterable[Metric]:
    """The quota stream's families: over-admission (must stay 0), reports, open streams."""
    yield CounterMetricFamily("extauthz_quota_overadmission", "Tokens granted past the limit as this "
                              "replica's ledger and the store's prove them (must stay 0).",
                              value=book.overadmission)
    yield CounterMetricFamily("extauthz_quota_reported_excess", "Usage report entries allowing more "
                              "than the share sent could (self-reported; entries, not requests).",
                              value=book.reported_excess)
    yield CounterMetricFamily("extauthz_quota_coalesced", "Usage report entries coalesced: sooner than "
                              "half a report interval after the bucket's last one on the stream.",
                              value=book.coalesced)
    yield CounterMetricFamily("extauthz_quota_ledger_resets", "Times the store's quota ledger was found "
                              "lost (this replica's marker gone): no share grew for the assignments' TTL "
                              "and cooling after.", value=book.ledger_resets)
    yield CounterMetricFamily("extauthz_quota_reports", "Usage reports read on quota streams.",
                              value=book.reports)
    streams = GaugeMetricFamily("extauthz_quota_streams", "Quota streams (RLQS) open on this replica.",
                                value=sum(1 for s in book.streams.values() if not s.gone_at))
    yield streams
    refused = CounterMetricFamily("extauthz_quota_refused", "Quota streams or reports refused by a "
                                  "bound, by reason.", labels=["reason"])
    for reason in ("streams", "buckets", "outbox"):
        refused.add_metric([reason], book.refused.get(reason, 0))
    yield refused
    yield CounterMetricFamily("extauthz_quota_shed_denials", "DENY_ALL answers sent to shedders' tier "
                              "buckets (envoy_deny_all: a tier shed whole).", value=book.shed_denials)
