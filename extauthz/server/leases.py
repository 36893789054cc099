"""The server's side of the lease loop, in one owner.

A check admitted with leases (concurrency slots held until the request finishes) is answered
with the lease metadata (:func:`extauthz.engine.answers.lease_fields`) and a lease ticket; Envoy's
access log hands the metadata back when the request finishes and the leases are released.
:class:`Leases` holds what the server keeps between the two, for both front doors (gRPC and
HTTP, through :mod:`extauthz.server.flow`) and the AccessLogService:

* :meth:`Leases.admitted`: remember an admitted check's leases by request id
  (:class:`LeaseIndex`) and make the ticket its answer carries;
* :meth:`Leases.abandoned`: give back the leases of an answer Envoy will never log;
* :meth:`Leases.refused`: vet the lease metadata of an access-log entry (the ticket) before
  anything acts on it;
* :meth:`Leases.finished`: match a finished request's entry to its leases (its metadata, or
  the request-id index when Envoy dropped our answer) and hand them to the releaser
  (:class:`~extauthz.engine.release.Releaser`, the one release path).

:class:`FinishedEntries` is what both release receivers (the gRPC AccessLogService in
``server/services.py`` and the fluentd port in ``server/fluentd.py``) do with one finished
request's entry, once they have read its fields: vet the metadata, match, release, count;
and count the requests Envoy let through unchecked (``failure_mode_allow``: the entry carries
Envoy's fail-open header and no decision of ours), by the tier the policy's classifier gives
what the entry shows of the request (:meth:`FinishedEntries.entry`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection, Mapping, Sequence

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RawRequest, RequestContext
from ..core.errors import StoreError
from ..core.tiers import Tier
from ..core.verdict import Decision
from ..engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD, read_lease_fields
from ..engine.engine import Engine
from ..engine.tickets import MALFORMED, LeaseTickets
from ..limiters import FleetUsageShedder
from ..limiters.base import applies
from ..store.base import LeaseOp

__all__ = ["MAX_PENDING_RELEASES", "UNKNOWN_TIER", "FinishedEntries", "Lease",
           "LeaseIndex", "Leases", "engine_index", "seen_as", "seen_at"]

Lease = tuple[tuple[str, ...], str]

#: the tier of an unchecked request whose entry does not show the request (no method)
UNKNOWN_TIER = "unknown"


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



def engine_index(engine: Engine) -> LeaseIndex:
    """The request-id index of a server around ``engine``: its clock, entries kept for the
    current policy's longest lease TTL."""
    return LeaseIndex(clock=engine.clock, retention=lambda: engine.snapshot.policy.longest_lease_ttl)


class Leases:
    """The owner of the server's side of the lease loop (module docstring): one per server,
    shared by both front doors and the access log."""

    def __init__(self, engine: Engine, *, tickets: LeaseTickets | None = None,
                 index: LeaseIndex | None = None) -> None:
        self.engine = engine
        #: request id -> leases of admitted checks, until their access-log entry
        self.index = index if index is not None else engine_index(engine)
        #: makes the ticket each answer with leases carries, and checks it on the way back
        self.tickets = tickets if tickets is not None else LeaseTickets(engine.keys)
        self.releaser = engine.releaser

    def admitted(self, ctx: RequestContext, decision: Decision, seen: str) -> str:
        """Remember an admitted request's leases by request id until its access-log entry
        (``seen``: what identifies the request, :func:`seen_at` or :func:`seen_as`); the
        lease ticket its answer carries."""
        if ctx.request_id:
            self.index.put(ctx.request_id, decision.leases, decision.lease_id, seen)
        return self.tickets.make(decision.lease_id, decision.leases)

    def abandoned(self, decision: Decision) -> None:
        """Give back the leases of an answer Envoy will never log (it gave up on the check)."""
        self.releaser.release(decision.leases, decision.lease_id, "cancelled_check")

    def refused(self, lease: tuple[list[str], str] | None, ticket: str, ours: bool) -> str | None:
        """Why an access-log entry's lease metadata is refused (``tickets.REASONS``), or None.
        ``lease``: the (keys, lease id) it names, if it names them as a check writes them;
        ``ours``: it carries one of our fields at all (then a missing ``lease`` is malformed)."""
        if lease is not None:
            return self.tickets.check(lease[1], lease[0], ticket)
        return MALFORMED if ours else None

    def finished(self, request_id: str, lease: tuple[list[str], str] | None, *, unauthorized: bool,
                 seen: Callable[[], Collection[str]]) -> tuple[Sequence[str], str, str] | None:
        """The (keys, lease id, release path) a finished request's access-log entry gives back,
        or None. ``lease``: what its (vetted) metadata names; ``unauthorized``: the request was
        refused by the authorization filter; ``seen``: what the entry says of its request
        (asked only when the metadata is missing)."""
        path = "access_log"
        # A request we refused holds nothing: never let its entry (no metadata, maybe a
        # client-chosen request id shared with admitted requests) take another request's
        # leases from the index; without metadata, only the request the check saw finds its
        # entry (LeaseIndex.take).
        if request_id and not unauthorized:
            if lease is not None:
                self.index.take(request_id, lease[1])
            else:
                known = self.index.take(request_id, None, seen())
                if known is not None:
                    return known[0], known[1], "request_id_index"
        if lease is None:
            return None
        return lease[0], lease[1], path

    def release(self, keys: Sequence[str], lease_id: str, path: str) -> asyncio.Task[int] | None:
        """Hand leases to the releaser (None: released at once, the embedded store)."""
        return self.releaser.release(keys, lease_id, path)


#: unchecked requests the fleet limiters count while in flight, at most (the oldest first
#: forgotten: its lease then ends at its TTL)
MAX_UNCHECKED_IN_FLIGHT = 10_000


class _Unchecked:
    """An unchecked request the fleet limiters count in flight (:meth:`FinishedEntries.in_flight`):
    its lease (the keys it was taken in, one lease id for all of them) and when it ends unless
    a periodic entry renews it (the store's expiry: the limiters' longest ``lease_ttl``)."""

    __slots__ = ("expires", "keys", "lease_id")

    def __init__(self, keys: tuple[str, ...], lease_id: str, expires: float) -> None:
        self.keys = keys
        self.lease_id = lease_id
        self.expires = expires


#: release tasks one receiver (a gRPC access-log stream, a fluentd connection) keeps in flight
#: before it stops reading: a slow store must not let them pile up without bound.
MAX_PENDING_RELEASES = 1024


class FinishedEntries:
    """What a release receiver does with one finished request's access-log entry, the same for
    the gRPC access-log stream and the fluentd port (one instance per server, so ``/status``
    ``access_log`` and the rejected-release metric count both): vet its lease metadata
    (:meth:`Leases.refused`), match it to its leases (:meth:`Leases.finished`) and start the
    release. The receivers only read their wire format into the arguments of :meth:`entry`.
    """

    def __init__(self, leases: Leases, *,
                 on_finished: Callable[[str, float | None], None] | None = None) -> None:
        self.leases = leases
        #: entries refused before any store call, by reason (tickets.REASONS).
        self.rejected: dict[str, int] = {}
        #: entries read (intermediate ones included)
        self.entries = 0
        #: ``serve --record``: told (request id, duration in seconds or None) per finished request.
        self.on_finished = on_finished
        #: requests Envoy let through unchecked (its fail-open header, no decision of ours), by
        #: tier (``extauthz_unchecked_requests_total``, ``/status`` ``unchecked_requests``)
        self.unchecked: dict[str, int] = {}
        #: request id -> the fleet lease of an unchecked request in flight that the fleet
        #: limiters count (:meth:`in_flight`), until its last entry or its lease's expiry
        #: (renewed by each periodic entry), in renewal order (expiry order while lease_ttl stays)
        self._unchecked_held: dict[str, _Unchecked] = {}
        #: unchecked requests the fleet limiters counted in flight, and store calls that failed
        self.unchecked_counted = 0
        self.unchecked_errors = 0

    def entry(self, request_id: str, metadata: Mapping[str, object] | None, *, unauthorized: bool,
              seen: Callable[[], Collection[str]],
              duration: Callable[[], float | None] = lambda: None,
              failed_open: bool = False,
              request: Callable[[], RawRequest | None] = lambda: None) -> asyncio.Task[int] | None:
        """Handle one finished request's entry; the release task it started, if any (None:
        nothing to release, refused, or released at once by the embedded store).
        ``metadata``: the entry's ext_authz dynamic-metadata namespace (None: absent), its
        values as read from the wire (the lease fields are strings when a check wrote them);
        ``unauthorized``: the authorization filter refused the request; ``seen``: what the
        entry says of its request (:meth:`Leases.finished`); ``duration``: seconds from the
        request's start to its last byte downstream, for ``serve --record``; ``failed_open``:
        the entry carries Envoy's fail-open header (:data:`~extauthz.envoy.headers.FAILURE_MODE_HEADER`); ``request``:
        what the entry shows of the request for the classifier (None: nothing, the tier is
        ``unknown``), asked only for an unchecked request."""
        if self.on_finished is not None and request_id:
            self.on_finished(request_id, duration())
        if failed_open and metadata is None and not unauthorized:  # Envoy let it through on a failed check
            self.count_unchecked(request())
            held = self._unchecked_held.pop(request_id, None) if request_id else None
            if held is not None:  # the fleet counted it in flight: it is over (the releaser
                self.leases.release(held.keys, held.lease_id, "access_log")  # tracks the task)
        leases = self.leases
        lease = None
        if metadata is not None:
            lease = read_lease_fields(metadata.get(LEASE_ID_FIELD), metadata.get(LEASES_FIELD))
            ticket = metadata.get(LEASE_TICKET_FIELD) if lease is not None else ""
            refused = leases.refused(lease, ticket if isinstance(ticket, str) else "",
                                     LEASE_ID_FIELD in metadata or LEASES_FIELD in metadata)
            if refused is not None:  # forged, altered, foreign or malformed: nothing acts on
                # the entry, not even the request-id index
                self.rejected[refused] = self.rejected.get(refused, 0) + 1
                return None
        found = leases.finished(request_id, lease, unauthorized=unauthorized, seen=seen)
        if found is None:
            return None
        return leases.release(*found)

    @property
    def unchecked_held(self) -> Mapping[str, _Unchecked]:
        """The unchecked requests the fleet limiters count in flight now (those whose lease
        expired without a renewal forgotten first)."""
        self._expire_unchecked()
        return self._unchecked_held

    def _expire_unchecked(self) -> None:
        held = self._unchecked_held
        if not held:
            return
        now = self.leases.engine.clock.monotonic()
        while held:
            first = next(iter(held))
            if held[first].expires > now:
                break
            del held[first]  # no entry renewed it: the store dropped its lease (Envoy restarted)

    def in_flight(self, request_id: str, metadata: Mapping[str, object] | None, *, failed_open: bool,
                  request: Callable[[], RawRequest | None]) -> asyncio.Task[None] | None:
        """An intermediate entry of a request still in flight (Envoy's ``access_log_flush_interval``;
        the entry at its start comes before ext_authz ran and says nothing): when it carries the
        fail-open header and no decision of ours, the ``fleet_usage`` limiters that apply to it
        and are not ``off`` count it from now until its last entry, a lease taken without a
        limit (the request is already through: it takes a slot, it is never refused), renewed
        by each periodic entry (one store call, the same lease id) and forgotten at its TTL when
        no entry renews it. The task of the store call."""
        if not (failed_open and metadata is None and request_id):
            return None
        raw = request()
        if raw is None or not raw.method:
            return None
        self._expire_unchecked()
        engine = self.leases.engine
        snap = engine.snapshot
        ctx = snap.classifier.context(raw)
        fleet = [lim for lim, _ in snap.active
                 if isinstance(lim, FleetUsageShedder) and applies(lim.applies_to, ctx)]
        ops = [LeaseOp(lim.critical_key if ctx.tier is Tier.CRITICAL else lim.other_key, 0, lim.ttl)
               for lim in fleet]
        held = self._unchecked_held.pop(request_id, None)
        if not ops:
            if held is not None:  # its limiters were switched off: the slot goes back
                self.leases.release(held.keys, held.lease_id, "access_log")
            return None
        keys = tuple(op.key for op in ops)
        expires = engine.clock.monotonic() + max(op.ttl for op in ops)
        if held is None:
            if len(self._unchecked_held) >= MAX_UNCHECKED_IN_FLIGHT:
                del self._unchecked_held[next(iter(self._unchecked_held))]
            held = _Unchecked(keys, os.urandom(8).hex(), expires)
            first = True
        else:  # renewed: it moves to the end (expiry order)
            held = _Unchecked(tuple(dict.fromkeys((*held.keys, *keys))), held.lease_id, expires)
            first = False
        self._unchecked_held[request_id] = held
        return asyncio.ensure_future(self._count(request_id, held, ops, first))

    async def _count(self, request_id: str, held: _Unchecked, ops: list[LeaseOp], first: bool) -> None:
        try:
            await self.leases.engine.store.check(ops, held.lease_id)
        except StoreError:
            self.unchecked_errors += 1
            if first and self._unchecked_held.get(request_id) is held:
                del self._unchecked_held[request_id]
            return
        if first:
            self.unchecked_counted += 1
        now = self._unchecked_held.get(request_id)
        if now is None or now.lease_id != held.lease_id:
            # its last entry (or a switch-off, or its expiry) came while the call was on its
            # way: the call may have taken the slot again after that release
            self.leases.release(held.keys, held.lease_id, "access_log")

    def count_unchecked(self, raw: RawRequest | None) -> None:
        """Count one request Envoy let through unchecked, by the tier the policy's classifier
        gives what its entry shows (method, path, authority, the logged headers, the route's
        tier tag; never the identity: no API key is logged), or ``unknown``."""
        tier = (self.leases.engine.snapshot.classifier.context(raw).tier.value
                if raw is not None and raw.method else UNKNOWN_TIER)
        self.unchecked[tier] = self.unchecked.get(tier, 0) + 1
