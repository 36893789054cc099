"""gRPC servicers: Authorization/Check and AccessLogService/StreamAccessLogs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection

import grpc

from ..answers import LEASE_ID_FIELD, LEASES_FIELD
from ..clock import SYSTEM_CLOCK, Clock
from ..context import RequestContext
from ..engine import Engine
from ..proto import (
    accesslog_data_pb2,
    accesslog_pb2,
    accesslog_pb2_grpc,
    auth_pb2,
    auth_pb2_grpc,
    core_pb2,
)
from ..throttle import LogThrottle
from ..tickets import MALFORMED, LeaseTickets
from ..verdict import Decision
from .edge import EXT_AUTHZ_NAMESPACE, check_response, lease_release, lease_ticket, raw_request

log = logging.getLogger("extauthz.server")

MAX_PENDING_RELEASES = 1024

Lease = tuple[tuple[str, ...], str]


def seen_at(started_us: int) -> str:
    """What a gRPC Check saw of its request, as the index keeps it: Envoy's start time of the
    downstream stream (``attributes.request.time``; the access-log entry's ``start_time`` is
    the same instant, to the microsecond)."""
    return f"t:{started_us}"


def seen_as(method: str, path: str) -> str:
    """What an HTTP-protocol check saw (that protocol carries no start time): method and path
    without the query."""
    q = path.find("?")
    return f"p:{method} {path if q < 0 else path[:q]}"


class _Held:
    """A request id's entries in the index: lease id -> (keys, what the check saw), and how
    many checks saw the id."""

    __slots__ = ("checks", "leases")

    def __init__(self) -> None:
        self.checks = 0
        self.leases: dict[str, tuple[tuple[str, ...], str]] = {}


class LeaseIndex:
    """Request id (``x-request-id``) -> leases of the requests this replica admitted, until
    their access-log entry arrives.

    Envoy logs every finished request with its request id, but the CheckResponse's dynamic
    metadata is missing from the entry when Envoy dropped our answer: the client went away
    or the ext_authz timeout fired while the answer was on its way. The index still finds
    those leases (on the replica that answered; elsewhere the lease TTL remains the
    backstop), but only for an entry that is the request the check saw (:meth:`take`).

    Bounded (docs/security.md "Request ids and paths"): ``per_id`` entries per request id
    (a reused id's oldest entry is forgotten first), ``limit`` entries in all (the oldest
    first), and an entry is forgotten ``retention()`` seconds after its check (the policy's
    longest lease TTL: by then the store has dropped the lease). Every operation is O(1)
    amortized: entries are found by (request id, lease id) and expire in insertion order.
    """

    def __init__(self, limit: int = 100_000, per_id: int = 8, *, clock: Clock = SYSTEM_CLOCK,
                 retention: Callable[[], float] = lambda: 60.0) -> None:
        if limit < 1 or per_id < 1:
            raise ValueError(f"limit and per_id must be at least 1, not {limit} and {per_id}")
        self.limit = limit
        self.per_id = per_id
        self.clock = clock
        self.retention = retention
        self._by_id: dict[str, _Held] = {}
        #: (request id, lease id) -> when its check put it, oldest first
        self._order: dict[tuple[str, str], float] = {}
        #: entries forgotten before their access-log entry: ``expired`` (retention passed),
        #: ``evicted`` (a bound)
        self.expired = 0
        self.evicted = 0

    def __len__(self) -> int:
        """Entries (leases awaiting their access-log entry), not request ids."""
        return len(self._order)

    def status(self) -> dict[str, int]:
        self.expire()
        return {"entries": len(self._order), "request_ids": len(self._by_id),
                "expired": self.expired, "evicted": self.evicted}

    def put(self, request_id: str, leases: tuple[str, ...], lease_id: str, seen: str = "") -> None:
        """Remember an admitted check's leases; ``seen``: :func:`seen_at` or :func:`seen_as`."""
        self.expire()
        held = self._by_id.get(request_id)
        if held is None:
            held = self._by_id[request_id] = _Held()
        held.checks += 1
        if len(held.leases) >= self.per_id:  # a reused id: its oldest entry goes
            self._forget(request_id, next(iter(held.leases)))
            self.evicted += 1
        held.leases[lease_id] = (leases, seen)
        self._order[(request_id, lease_id)] = self.clock.monotonic()
        if len(self._order) > self.limit:
            self._forget(*next(iter(self._order)))
            self.evicted += 1

    def take(self, request_id: str, lease_id: str | None, seen: Collection[str] = ()) -> Lease | None:
        """Forget (and return) the entry for ``lease_id``. Without one (the access log lost
        our answer), the request id's entry only when exactly one check saw that id and it
        saw this request (``seen``: what the access-log entry says of it); never one of
        several, never an entry for another request that shares a client-chosen id."""
        held = self._by_id.get(request_id)
        if held is None:
            return None
        if lease_id is None:
            if held.checks != 1 or len(held.leases) != 1:
                return None
            lease_id, (_, saw) = next(iter(held.leases.items()))
            if not saw or saw not in seen:
                return None
        entry = held.leases.get(lease_id)
        if entry is None:
            return None
        self._forget(request_id, lease_id)
        return entry[0], lease_id

    def expire(self) -> None:
        """Forget the entries older than ``retention()`` seconds (oldest first, so amortized O(1))."""
        if not self._order:
            return
        horizon = self.clock.monotonic() - self.retention()
        order = self._order
        while order:
            key = next(iter(order))
            if order[key] > horizon:
                break
            self._forget(*key)
            self.expired += 1

    def _forget(self, request_id: str, lease_id: str) -> None:
        self._order.pop((request_id, lease_id), None)
        held = self._by_id.get(request_id)
        if held is None:
            return
        held.leases.pop(lease_id, None)
        if not held.leases:
            del self._by_id[request_id]


class AuthorizationService(auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    """Check: the edge reads the request, the engine decides (and never raises)."""

    def __init__(self, engine: Engine, index: LeaseIndex | None = None,
                 tickets: LeaseTickets | None = None) -> None:
        self.engine = engine
        self.index = index if index is not None else engine_index(engine)
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
            when = request.attributes.request.time
            ticket = self.admitted(ctx, decision, seen_at(when.seconds * 1_000_000 + when.nanos // 1000)
                                   if when.seconds else "")
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

    def admitted(self, ctx: RequestContext, decision: Decision, seen: str = "") -> str:
        """Remember an admitted request's leases by request id until its access-log entry
        (``seen``: what identifies the request, :func:`seen_at`; else method and path); the
        lease ticket its answer carries."""
        if ctx.request_id:
            self.index.put(ctx.request_id, decision.leases, decision.lease_id,
                           seen or seen_as(ctx.method, ctx.path))
        return self.tickets.make(decision.lease_id, decision.leases)

    def abandoned(self, decision: Decision) -> None:
        """Give back the leases of an answer Envoy will never log (it gave up on the check)."""
        self.engine.releaser.release(decision.leases, decision.lease_id, "cancelled_check")


def engine_index(engine: Engine) -> LeaseIndex:
    """The request-id index of a server around ``engine``: its clock, entries kept for the
    current policy's longest lease TTL."""
    return LeaseIndex(clock=engine.clock, retention=lambda: engine.snapshot.policy.longest_lease_ttl)


def entry_seen(entry: accesslog_data_pb2.HTTPAccessLogEntry) -> tuple[str, ...]:
    """What an access-log entry says of its request, in :meth:`LeaseIndex.take`'s terms."""
    start = entry.common_properties.start_time
    request = entry.request
    method = core_pb2.RequestMethod.Name(request.request_method)
    seen = [seen_at(start.seconds * 1_000_000 + start.nanos // 1000), seen_as(method, request.path)]
    if request.original_path:
        seen.append(seen_as(method, request.original_path))
    return tuple(seen)


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
        self.index = index if index is not None else engine_index(engine)
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
                    # another request's leases from the index; without metadata, only the
                    # request the check saw finds its entry (LeaseIndex.take).
                    if rid and not common.response_flags.HasField("unauthorized_details"):
                        known = self.index.take(rid, lease[1] if lease is not None else None,
                                                () if lease is not None else entry_seen(entry))
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

