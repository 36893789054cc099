"""gRPC servicers: Authorization/Check and AccessLogService/StreamAccessLogs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from ..answers import LEASE_ID_FIELD, LEASES_FIELD
from ..context import RequestContext
from ..engine import Engine
from ..proto import accesslog_data_pb2, accesslog_pb2, accesslog_pb2_grpc, auth_pb2, auth_pb2_grpc
from ..throttle import LogThrottle
from ..tickets import MALFORMED, LeaseTickets
from ..verdict import Decision
from .edge import EXT_AUTHZ_NAMESPACE, check_response, lease_release, lease_ticket, raw_request

log = logging.getLogger("extauthz.server")

MAX_PENDING_RELEASES = 1024

Lease = tuple[tuple[str, ...], str]


class LeaseIndex:
    """Request id (``x-request-id``) -> leases of the requests this replica admitted, until
    their access-log entry arrives.

    Envoy logs every finished request with its request id, but the CheckResponse's dynamic
    metadata is missing from the entry when Envoy dropped our answer: the client went away
    or the ext_authz timeout fired while the answer was on its way. The index still finds
    those leases (on the replica that answered; elsewhere the lease TTL remains the
    backstop). Bounded: the oldest request ids are forgotten first.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._by_id: dict[str, list[Lease]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, request_id: str, leases: tuple[str, ...], lease_id: str) -> None:
        entry = self._by_id.get(request_id)
        if entry is None:
            self._by_id[request_id] = [(leases, lease_id)]
            if len(self._by_id) > self.limit:
                del self._by_id[next(iter(self._by_id))]
        else:  # a client-chosen x-request-id used twice
            entry.append((leases, lease_id))

    def take(self, request_id: str, lease_id: str | None) -> Lease | None:
        """Forget (and return) the entry for ``lease_id``, or the oldest one for the
        request id when the access log did not say which lease it was."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return None
        i = 0 if lease_id is None else next((k for k, e in enumerate(entry) if e[1] == lease_id), -1)
        if i < 0:
            return None
        lease = entry.pop(i)
        if not entry:
            del self._by_id[request_id]
        return lease


class AuthorizationService(auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    """Check: the edge reads the request, the engine decides (and never raises)."""

    def __init__(self, engine: Engine, index: LeaseIndex | None = None,
                 tickets: LeaseTickets | None = None) -> None:
        self.engine = engine
        self.index = index if index is not None else LeaseIndex()
        #: makes the lease ticket each answer with leases carries (shared with the access log)
        self.tickets = tickets if tickets is not None else LeaseTickets(engine.keys)
        #: requests the edge could not read (answered allowed): ``extauthz_bad_requests_total``
        self.bad_requests = 0
        self._bad_log = LogThrottle(log)

    async def Check(  # noqa: N802 - gRPC method name
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.CheckResponse:
        engine = self.engine
        snap = engine.snapshot
        try:
            raw = raw_request(request, snap.classifier.needed_headers,
                              snap.policy.needed_route_metadata, snap.classifier.needed_metadata)
            ctx = snap.classifier.context(raw)
        except Exception as exc:  # a request the edge cannot read: allowed, counted here
            self.bad_request("a CheckRequest", exc)
            return auth_pb2.CheckResponse(ok_response=auth_pb2.OkHttpResponse())
        # Never raises (failures are decided by failure_mode and counted in the engine). A
        # cancellation while the store call is out is handled there too (the answer's
        # leases are given back when it lands).
        decision = await engine.decide(ctx)
        if decision.leases:
            ticket = self.admitted(ctx, decision)
            # Envoy may reset the call after we answer (client abort, ext_authz timeout):
            # then the answer, and the leases in it, never reach the access log.
            context.add_done_callback(lambda c: self.abandoned(decision) if c.cancelled() else None)
            return check_response(ctx, decision, ticket)
        return check_response(ctx, decision)

    # -- shared by both edges (gRPC here, HTTP in server/http.py)
    def bad_request(self, what: str, exc: Exception) -> None:
        """Count (and log, throttled) a request the edge could not read; it was allowed."""
        self.bad_requests += 1
        self._bad_log.log(logging.WARNING, "could not read %s; allowing it: %s: %s", what,
                          type(exc).__name__, exc, fields={"event": "bad_request"})

    def admitted(self, ctx: RequestContext, decision: Decision) -> str:
        """Remember an admitted request's leases by request id until its access-log entry;
        the lease ticket its answer carries."""
        if ctx.request_id:
            self.index.put(ctx.request_id, decision.leases, decision.lease_id)
        return self.tickets.make(decision.lease_id, decision.leases)

    def abandoned(self, decision: Decision) -> None:
        """Give back the leases of an answer Envoy will never log (it gave up on the check)."""
        self.engine.releaser.release(decision.leases, decision.lease_id, "cancelled_check")


def finished_after(common: accesslog_data_pb2.AccessLogCommon) -> float | None:
    """Seconds from the request's start to the last byte sent downstream, if Envoy says."""
    if not common.HasField("time_to_last_downstream_tx_byte"):
        return None
    d = common.time_to_last_downstream_tx_byte
    return float(d.seconds + d.nanos / 1e9)


class AccessLogService(accesslog_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Releases (through the engine's :class:`~extauthz.release.Releaser`) the leases of
    every finished request that Envoy's access log reports."""

    def __init__(self, engine: Engine, index: LeaseIndex | None = None,
                 tickets: LeaseTickets | None = None, *,
                 on_finished: Callable[[str, float | None], None] | None = None) -> None:
        self.engine = engine
        self.index = index if index is not None else LeaseIndex()
        #: checks every lease an entry names before any store call (shared with Check).
        self.tickets = tickets if tickets is not None else LeaseTickets(engine.keys)
        #: entries refused before any store call, by reason (tickets.REASONS).
        self.rejected: dict[str, int] = {}
        self.entries = 0
        #: ``serve --record``: told (request id, duration in seconds or None) per finished request.
        self.on_finished = on_finished

    async def StreamAccessLogs(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[accesslog_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> accesslog_pb2.StreamAccessLogsResponse:
        # Releases run as tasks so that reading the stream never waits on the store: a
        # slow release must not hold back the entries behind it (their leases would
        # linger and inflate every in-flight count). At most MAX_PENDING at a time.
        release = self.engine.releaser.release
        pending: set[asyncio.Task[int]] = set()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    self.entries += 1
                    common = entry.common_properties
                    if common.intermediate_log_entry:
                        continue
                    if self.on_finished is not None and entry.request.request_id:
                        self.on_finished(entry.request.request_id, finished_after(common))
                    fm = common.metadata.filter_metadata
                    lease = None
                    if EXT_AUTHZ_NAMESPACE in fm:
                        md = fm[EXT_AUTHZ_NAMESPACE]
                        lease = lease_release(md)
                        refused = None
                        if lease is not None:
                            refused = self.tickets.check(lease[1], lease[0], lease_ticket(md))
                        elif LEASE_ID_FIELD in md.fields or LEASES_FIELD in md.fields:
                            refused = MALFORMED  # our fields, not as a check writes them: not Envoy's
                        if refused is not None:  # forged, altered, foreign or malformed: nothing
                            # acts on the entry, not even the request-id index
                            self.rejected[refused] = self.rejected.get(refused, 0) + 1
                            continue
                    path = "access_log"
                    rid = entry.request.request_id
                    # A request we refused holds nothing: never let its entry (no metadata,
                    # maybe a client-chosen request id shared with admitted requests) take
                    # another request's leases from the index.
                    if rid and not common.response_flags.HasField("unauthorized_details"):
                        known = self.index.take(rid, lease[1] if lease is not None else None)
                        if lease is None and known is not None:
                            path = "request_id_index"
                            lease = (list(known[0]), known[1])
                    if lease is None:
                        continue
                    if len(pending) >= MAX_PENDING_RELEASES:
                        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        pending -= done
                    task = release(lease[0], lease[1], path)  # None: done at once (embedded store)
                    if task is not None:
                        pending.add(task)
                        task.add_done_callback(pending.discard)
        finally:
            if pending:
                await asyncio.wait(pending)
        return accesslog_pb2.StreamAccessLogsResponse()

