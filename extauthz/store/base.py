"""The store contract: every store (embedded memory, Redis) implements it the same way.

A Check sends all store-backed limiters' operations in one :meth:`Store.check` call,
which is atomic and commits nothing unless the request is admitted:

* each op is evaluated on its own (``allowed`` in its :class:`OpResult`);
* the request is admitted when every op with ``enforce=True`` allows;
* only then is every op that allows committed (tokens taken, lease added); an op in
  shadow mode that would refuse is not committed and does not block the others.

Leases are released by the access-log path (:meth:`Store.release`) or expire after
their TTL; expired leases are swept inside the same atomic operation that reads them.

The rules themselves (refill, admit, sweep, the answers' numbers, the shed controller) are
defined once, in :mod:`extauthz.store.algorithms`, and every store follows them exactly.

The op kinds form one table (:data:`OP_KINDS`): each op class declares its ``check.lua`` code
(``CODE``) and the order of its three ARGV there (``ARGS``), its rule is
``algorithms.RULES[kind]``, and ``tests/store/test_op_table.py`` checks that every kind has
a rule, a ``check.lua`` branch and a generator in the differential test. Adding an op kind
is those four steps (docs/design.md, "Adding a store op kind").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Protocol

from ..core.errors import StoreUnavailable

#: compare-and-set attempts of one :func:`update_value` while other writers keep changing it
SWAP_ATTEMPTS = 8

# Each op kind below declares what ``check.lua`` reads of it: ``CODE``, its one-letter kind
# (ARGV[a]; "r" is the release entry's), then ARGV[a+1] is ``enforce`` ("1"/"0") and
# ``ARGS`` names the three ARGV after it (ARGV[a+2..a+4]) in order: a field, several fields
# joined by one space, or "" (sent empty). A float field is sent as ``repr(float)``, an int
# as an integer, a str as it is (extauthz.store.redis.wire packs them from this).


@dataclass(frozen=True, slots=True)
class BucketOp:
    """Token bucket: ``rate`` tokens/s refilled continuously up to ``burst``; take ``cost``."""

    CODE: ClassVar[str] = "b"
    ARGS: ClassVar[tuple[str, str, str]] = ("rate", "burst", "cost")

    key: str
    rate: float
    burst: float
    cost: float
    enforce: bool = True

    @property
    def ttl(self) -> int:
        return bucket_ttl(self.rate, self.burst)


def bucket_ttl(rate: float, burst: float) -> int:
    """Seconds an idle bucket is kept: twice the fill time, at least 1 (Redis refuses 0).
    A bucket idle that long is full again, so forgetting it changes no answer.
    ``lua/check.lua`` computes the same ``max(1, ceil(2 * burst / rate))``; grants and
    give-backs keep their bucket the same way."""
    return max(1, math.ceil(2 * burst / rate))


@dataclass(frozen=True, slots=True)
class LeaseOp:
    """Hold a lease in ``key`` while fewer than ``limit`` are live (``limit`` 0: count only)."""

    CODE: ClassVar[str] = "l"
    ARGS: ClassVar[tuple[str, str, str]] = ("limit", "ttl", "")

    key: str
    limit: int
    ttl: float
    enforce: bool = True


@dataclass(frozen=True, slots=True)
class CountOp:
    """A quota window's count: add ``cost`` while the count stays within ``limit``. ``key``
    names one window (its start is part of the key); a new count expires ``ttl`` seconds
    later (the window's end plus a margin). ``reset``: seconds from now to the window's end,
    what the answer reports (not sent to the store)."""

    CODE: ClassVar[str] = "q"
    ARGS: ClassVar[tuple[str, str, str]] = ("limit", "cost", "ttl")

    key: str
    limit: int
    cost: int
    ttl: int
    reset: float
    enforce: bool = True


@dataclass(frozen=True, slots=True)
class GrantOp:
    """Batched grants (``consistency: batched``): the replica gives back the ``held``
    tokens left of its last grant (less than one request's cost) and takes up to ``want``
    tokens from the shared bucket ``key``, when the bucket with them admits ``cost`` (the
    request that asked). Refill, admit and TTL are :class:`BucketOp`'s; the grant is
    :func:`~extauthz.store.algorithms.grant_size`, taken atomically before any of it is
    spent."""

    CODE: ClassVar[str] = "g"
    ARGS: ClassVar[tuple[str, str, str]] = ("rate", "burst", "cost want held")

    key: str
    rate: float
    burst: float
    cost: float
    want: float
    enforce: bool = True
    held: float = 0.0


@dataclass(frozen=True, slots=True)
class ReturnOp:
    """Give ``amount`` unspent granted tokens back to the shared bucket ``key`` (capped at
    ``burst``; :func:`~extauthz.store.algorithms.give_back`). Always allowed."""

    CODE: ClassVar[str] = "u"
    ARGS: ClassVar[tuple[str, str, str]] = ("rate", "burst", "amount")

    key: str
    rate: float
    burst: float
    amount: float
    enforce: bool = False


@dataclass(frozen=True, slots=True)
class QuotaGrantOp:
    """Batched grants of a quota (``consistency: batched``): the replica gives back the
    ``held`` units left of its last grant (less than one request's cost) and takes up to
    ``want`` units of the window's count ``key``, when the count without them admits
    ``cost`` (the request that asked). Window, TTL and ``reset`` are :class:`CountOp`'s;
    the grant is :func:`~extauthz.store.algorithms.quota_grant_size`, added to the count
    atomically before any of it is spent."""

    CODE: ClassVar[str] = "c"
    ARGS: ClassVar[tuple[str, str, str]] = ("limit", "cost want held", "ttl")

    key: str
    limit: int
    cost: int
    want: int
    ttl: int
    reset: float
    enforce: bool = True
    held: int = 0


@dataclass(frozen=True, slots=True)
class QuotaReturnOp:
    """Give ``amount`` unspent granted quota units back to the window's count ``key``
    (:func:`~extauthz.store.algorithms.quota_give_back`; nothing when the window's count is
    gone). Always allowed."""

    CODE: ClassVar[str] = "v"
    ARGS: ClassVar[tuple[str, str, str]] = ("amount", "", "")

    key: str
    amount: int
    enforce: bool = False


@dataclass(frozen=True, slots=True)
class FleetGrantOp:
    """Batched grants of fleet slots (``fleet_usage``, ``consistency: batched``): the
    replica's grant ``grant`` is ``have`` members ``<grant>:0 .. <grant>:have-1`` of the
    lease ZSET ``key``, each a slot with an expiry score, ``used`` of them by requests in
    flight there. With ``want > 0`` it grows by up to ``want`` slots, allowed when a slot
    is free for the asking request; with ``want <= 0`` it shrinks to ``have + want``
    (always allowed). Either way it keeps the slots in use (restored when they expired)
    and no free slot past ``limit`` (:func:`~extauthz.store.algorithms.fleet_grant_top`,
    ``limit`` 0: count only), and every member it keeps gets a new expiry, ``ttl`` seconds
    from now (the renewal): a replica that stops renewing gives its slots back when the
    TTL runs out."""

    CODE: ClassVar[str] = "f"
    ARGS: ClassVar[tuple[str, str, str]] = ("limit", "ttl", "grant have want used")

    key: str
    limit: int
    ttl: float
    grant: str
    have: int
    want: int
    enforce: bool = True
    used: int = 0


@dataclass(frozen=True, slots=True)
class SliceOp:
    """A slice of a ledger (the rate limit quota service's shares across replicas,
    docs/rlqs.md): the ledger ``key`` holds, per holder, a slice of whole units of one
    number (a limiter's tokens per fill interval, or its burst) under an expiry. The op
    sets ``holder``'s slice to ``want`` units, or to what is left of ``total`` by the
    other holders' live slices when less (:func:`~extauthz.store.algorithms.slice_top`;
    0 returns it), expiring ``ttl`` seconds from now (the renewal): so the live slices
    never sum past ``total`` while each is taken here, and a holder that stops renewing
    gives its slice back when the TTL runs out. Always allowed (a renewal or a shrink
    never fails); the answer's ``extra`` is the slice held after it."""

    CODE: ClassVar[str] = "s"
    ARGS: ClassVar[tuple[str, str, str]] = ("total", "ttl", "holder want")

    key: str
    total: int
    ttl: float
    holder: str
    want: int
    enforce: bool = False


@dataclass(frozen=True, slots=True)
class PeekOp:
    """A read of one key's state (:meth:`Store.peek`): ``kind`` ``bucket`` (with the
    limiter's ``rate`` and ``burst``, to refill it to now), ``count`` (a quota window) or
    ``leases`` (a lease ZSET)."""

    kind: str
    key: str
    rate: float = 0.0
    burst: float = 0.0


Op = BucketOp | LeaseOp | CountOp | GrantOp | ReturnOp | QuotaGrantOp | QuotaReturnOp | FleetGrantOp | SliceOp
#: every op kind, the table's rows (the members of :data:`Op`; a test keeps the two the same)
OP_KINDS: Final = (BucketOp, LeaseOp, CountOp, GrantOp, ReturnOp, QuotaGrantOp, QuotaReturnOp, FleetGrantOp,
                   SliceOp)


@dataclass(frozen=True, slots=True)
class OpResult:
    allowed: bool
    #: tokens left (bucket), free slots (lease) or requests left in the window (count),
    #: after this request if it was admitted.
    remaining: float
    #: bucket: seconds until ``cost`` tokens are there (0 when allowed); lease: 0; count:
    #: seconds to the window's end when refused (0 when allowed); quota grant: seconds to
    #: the window's end (allowed or not); fleet grant: the leases past ``limit`` after it
    #: (:func:`~extauthz.store.algorithms.fleet_grant_over`); slice: the units the ledger
    #: holds past ``total`` after it (:func:`~extauthz.store.algorithms.slice_over`).
    retry_after: float
    #: bucket: seconds until the bucket is full again; lease: live leases after the call;
    #: count: seconds to the window's end; grant (tokens or quota units): the amount
    #: granted (> 0), or, when nothing was committed, minus the ``held`` amount the replica
    #: keeps (<= 0); return: 0; fleet grant: the replica's grant size after the call, or
    #: -1 when nothing was committed; slice: the holder's slice after the call.
    extra: float


@dataclass(frozen=True, slots=True)
class CheckResult:
    admitted: bool
    results: tuple[OpResult, ...]


@dataclass(slots=True)
class StoreStats:
    """A store's round-trip counters (the Redis store's; for benchmarks, status, metrics)."""

    #: script calls sent (one EVALSHA each; NOSCRIPT retries included)
    commands: int = 0
    #: round trips: one per pipeline or single call (SCRIPT LOADs included)
    round_trips: int = 0
    script_loads: int = 0
    #: Redis Cluster: groups given back because another group refused (or failed)
    compensations: int = 0
    compensation_errors: int = 0


class Store(Protocol):
    """The store contract. Its capabilities are declared here, not discovered: a store
    without one states so (:class:`StoreBase` holds the answers of a store that has none)."""

    #: a short name for metrics and status: ``memory``, ``redis``, ``redis-cluster``...
    name: str

    @property
    def immediate(self) -> bool:
        """True when :meth:`check` answers within the call (the embedded store): the engine
        needs no task and no deadline, and :meth:`release_now` releases synchronously."""

    @property
    def per_master(self) -> bool:
        """True when keys live on several masters (Redis Cluster): the engine keeps one
        breaker per :meth:`node_of` name."""

    @property
    def stats(self) -> StoreStats | None:
        """Round-trip counters (exported on metrics), or None when the store keeps none."""

    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        """Evaluate ``ops`` atomically; commit iff admitted (see the module docstring)."""

    async def release(self, keys: Sequence[str], lease_id: str) -> int:
        """Drop ``lease_id`` from each lease key. Idempotent; returns how many were held."""

    def release_now(self, keys: Sequence[str], lease_id: str) -> int:
        """:meth:`release` within the call; only an :attr:`immediate` store has it (the others
        raise NotImplementedError)."""

    def node_of(self, key: str) -> str:
        """The name of the master holding ``key`` (``""`` unless :attr:`per_master`)."""

    def waiting(self, lease_id: str) -> list[tuple[str, float | None]] | None:
        """The parts of the check ``lease_id`` under way that the store has not answered:
        each part's master (:meth:`node_of`) and how long (seconds) it has waited in the
        store since it was written, or None while it is still queued in this server (not
        written yet); ``[]`` when the store has answered every part (this server's loop has
        not carried the answer yet); None when the store cannot tell. The engine asks it
        when a deadline passes: the deadline is measured from the write, against the store,
        not against this server's own busy loop."""

    async def inflight(self, keys: Sequence[str]) -> list[int]:
        """Live (unexpired) leases per key."""

    async def peek(self, ops: Sequence[PeekOp]) -> list[float]:
        """Each op's state as :meth:`check` would read it now, changing nothing (no sweep,
        no TTL, no write): a bucket's tokens refilled to the store's now
        (:func:`~extauthz.store.algorithms.refill`), a quota window's count, a lease key's
        live leases. For ``extauthz inspect``; never on the request path."""

    async def get_value(self, key: str) -> str | None:
        """A plain value (published signals, switches)."""

    async def set_value(self, key: str, value: str | None, ttl: float | None = None) -> None:
        """Set or (``None``) delete a plain value."""

    async def swap_value(self, key: str, expected: str | None, value: str | None,
                         ttl: float | None = None) -> bool:
        """Set (``None``: delete) ``key`` to ``value`` (``ttl`` seconds to live; None: kept)
        only while it still holds ``expected`` (``None``: no value): a compare-and-set. False
        when another writer changed it first (nothing written)."""

    async def shed_update(self, key: str, utilization: float, params: ShedParams) -> float:
        """Advance the shared shed controller with a new utilization sample; return the level."""

    async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
        """Append ``events`` (JSON strings) to the bounded event log ``key``: about ``maxlen``
        newest kept, the whole log dropped ``ttl`` seconds after the last append."""

    async def read_events(self, key: str, since: float) -> list[str]:
        """The events of ``key`` appended at or after ``since`` (Unix seconds), oldest first."""

    async def ping(self) -> None:
        """Raise :class:`~extauthz.core.errors.StoreError` when the store cannot answer."""

    async def close(self) -> None: ...


class StoreBase:
    """The capabilities a store does not have, declared once: stores (and test doubles)
    inherit it and override what they offer."""

    immediate = False
    per_master = False
    stats: StoreStats | None = None

    def release_now(self, keys: Sequence[str], lease_id: str) -> int:
        raise NotImplementedError(f"{type(self).__name__} releases only through release()")

    def node_of(self, key: str) -> str:
        return ""

    def waiting(self, lease_id: str) -> list[tuple[str, float | None]] | None:
        return None


@dataclass(frozen=True, slots=True)
class ShedParams:
    """The worker utilization controller's constants (see ``extauthz.limiters.worker``)."""

    good_below: float
    bad_above: float
    delay_before_shedding: float
    time_to_shed_all: float
    ttl: float

    @property
    def resting(self) -> float:
        """Where the level rests: ``delay_before_shedding`` of ramp below zero (float math)."""
        return -self.delay_before_shedding / self.time_to_shed_all


def load_json(text: str | bytes) -> object:
    """JSON written by an operator (a stored kill-switch or override value, an admin request
    body). Anything that does not parse is a ValueError with a short message, including a
    document nested too deeply for the parser (a RecursionError otherwise)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not JSON: {exc}") from None


async def update_value(store: Store, key: str,
                       change: Callable[[str | None], tuple[str | None, float | None]]) -> str | None:
    """The one read-modify-write of a plain value (kill switches, overrides): ``change`` maps
    the stored text to the new text (None: delete) and its TTL, and the write is a
    compare-and-set (:meth:`Store.swap_value`). When another writer (an operator on another
    replica or the CLI) changed the value in between, it is read again and ``change`` applied
    on top, so no change is lost. Returns the value written; raises
    :class:`~extauthz.core.errors.StoreUnavailable` after :data:`SWAP_ATTEMPTS` lost races."""
    for _ in range(SWAP_ATTEMPTS):
        stored = await store.get_value(key)
        value, ttl = change(stored)
        if await store.swap_value(key, stored, value, ttl):
            return value
    raise StoreUnavailable(f"{key} changed under {SWAP_ATTEMPTS} attempts in a row (other writers): try again")
