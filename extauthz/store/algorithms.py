"""The limiting rules, defined once: token bucket, leases, and the shed controller.

:data:`RULES` is the table of op kinds: one :class:`Rule` per kind (the state it reads,
whether it admits, what its commit leaves, its answer, what a Cluster gives back), built from
the functions below. Both stores follow these exactly, so that the embedded store and Redis give the same
answers (``tests/store/test_differential.py`` drives both through the same timelines and
requires identical decisions, remaining, retry-after and levels):

* the memory store calls every function here, through :data:`RULES`;
* the Redis store must change its state atomically inside Redis, so ``lua/check.lua``
  runs the minimal part of the rule, :func:`refill`, :func:`admits`, :func:`take`, the
  batched grants' :func:`grant_pool`, :func:`grant_size`, :func:`give_back` and
  :func:`grant_stamp`, the lease sweep (:func:`lease_live`), the quota count
  (:func:`count_admits`) and its batched grants (:func:`quota_pool`,
  :func:`quota_grant_size`, :func:`quota_give_back`) and the fleet grants
  (:func:`fleet_grant_admits`, :func:`fleet_grant_top`) and the ledger's slices
  (:func:`slice_live`, :func:`slice_top`), with the same float operations in the same order and the same
  :data:`TOKEN_EPSILON` (its header says so; a test pins the constant). The script
  returns raw state (tokens or live leases before the commit, and whether each op allows),
  and Python derives every reported number from it with the op's ``Rule.result``, as the
  memory store does;
* the shed controller (:func:`shed_advance`) runs only here, for both stores: Redis keeps
  its state (``lua/shed_state.lua``) and swaps it with a compare-and-set, so replicas
  sampling one fleet move at one controller's pace.

Every value crosses to Redis as ``repr(float)`` and back as Lua's ``%.17g``, both exact for
a double, so Lua and Python compute on bit-identical inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

from .base import (
    BucketOp,
    CountOp,
    FleetGrantOp,
    GrantOp,
    LeaseOp,
    Op,
    OpResult,
    QuotaGrantOp,
    QuotaReturnOp,
    ReturnOp,
    ShedParams,
    SliceOp,
)

#: A bucket holding ``cost - TOKEN_EPSILON`` tokens admits the request: float time arithmetic
#: must not refuse a request that arrives exactly on time (rate 7/s, burst 1: the next token
#: is there 1/7 s later, but ``(t + 1/7 - t) * 7`` is 0.9999999999999xx). ``lua/check.lua``
#: holds the same value.
TOKEN_EPSILON = 1e-9


# --------------------------------------------------------------------------- token bucket


def refill(tokens: float, last: float, now: float, rate: float, burst: float) -> float:
    """Tokens at ``now`` for a bucket that held ``tokens`` at ``last``: ``rate`` per second
    added continuously, capped at ``burst``. A clock going back adds nothing."""
    return min(burst, tokens + max(0.0, now - last) * rate)


def admits(tokens: float, cost: float) -> bool:
    """Whether a bucket holding ``tokens`` admits a request of ``cost`` tokens."""
    return tokens + TOKEN_EPSILON >= cost


def take(tokens: float, cost: float) -> float:
    """Tokens left after an admitted request: never below 0 (:data:`TOKEN_EPSILON`)."""
    return max(0.0, tokens - cost)


def bucket_result(op: BucketOp, allowed: bool, tokens: float, committed: bool) -> OpResult:
    """The answer for ``op`` from the tokens available before the request (refilled to now)."""
    left = take(tokens, op.cost) if committed else tokens
    retry = 0.0 if allowed else (op.cost - tokens) / op.rate
    return OpResult(allowed, left, retry, (op.burst - left) / op.rate)


# --------------------------------------------------------------------------- batched grants
# ``consistency: batched`` (extauthz.limiters.grants): a replica takes tokens from the shared
# bucket in grants and spends them locally. A grant is admitted by the bucket's own rule
# (:func:`admits` for the asking request's cost) and taken at once (:func:`take` of the
# whole grant), so the bucket never yields more than it would to exact requests; unspent
# tokens go back with :func:`give_back`.


def grant_pool(tokens: float, held: float, burst: float) -> float:
    """What a grant is taken from: the bucket's ``tokens`` with the asking replica's
    ``held`` remainder given back (:func:`give_back`), so that a remainder too small for
    one request still counts."""
    return give_back(tokens, held, burst)


def grant_size(pool: float, want: float) -> float:
    """Tokens a grant takes from a ``pool`` that admits it: ``want``, or all there is when
    less (at least the asking request's cost, within TOKEN_EPSILON)."""
    return min(want, pool)


def give_back(tokens: float, amount: float, burst: float) -> float:
    """Tokens after ``amount`` unspent granted tokens come back to a bucket holding
    ``tokens`` (refilled to now): never above ``burst`` (what refilled meanwhile while the
    grant was out is not added twice)."""
    return min(burst, tokens + amount)


def grant_stamp(now: float, last: float | None) -> float:
    """The time a grant or give-back stores with its bucket: ``now``, but never before the
    stored one. A give-back rides with a later check and carries the clock of its own loop
    turn (an injected clock; Redis TIME is read when it runs): stored back in time, the
    next refill would count the same seconds twice."""
    return now if last is None else max(now, last)


def grant_result(op: GrantOp, allowed: bool, tokens: float, committed: bool) -> OpResult:
    """The answer for a grant from the bucket's tokens before it: ``remaining`` is what the
    shared bucket holds after it; ``extra`` the tokens granted (> 0), or minus the ``held``
    tokens that stay with the replica when nothing was committed (<= 0)."""
    pool = grant_pool(tokens, op.held, op.burst)
    retry = 0.0 if allowed else (op.cost - pool) / op.rate
    if not committed:
        return OpResult(allowed, pool, retry, -op.held)
    granted = grant_size(pool, op.want)
    return OpResult(allowed, take(pool, granted), retry, granted)


def return_result(op: ReturnOp, allowed: bool, tokens: float, committed: bool) -> OpResult:
    """The answer for a return (always allowed): the shared bucket's tokens after it."""
    return OpResult(True, give_back(tokens, op.amount, op.burst), 0.0, 0.0)


# --------------------------------------------------------------------------- leases


def lease_live(expires_at: float, now: float) -> bool:
    """A lease is live strictly before its expiry; at ``expires_at == now`` it is swept
    (Redis: ``ZREMRANGEBYSCORE key -inf now``, inclusive)."""
    return expires_at > now


def lease_admits(live: int, limit: int) -> bool:
    """Whether a key holding ``live`` leases takes one more (``limit`` 0: count only)."""
    return limit <= 0 or live < limit


def lease_result(op: LeaseOp, allowed: bool, live: float, committed: bool) -> OpResult:
    """The answer for ``op`` from the live leases before the request (after the sweep)."""
    count = int(live) + 1 if committed else int(live)
    free = float(op.limit - count) if op.limit > 0 else float("inf")
    return OpResult(allowed, max(0.0, free), 0.0, float(count))


# --------------------------------------------------------------------------- quota counts


def count_admits(count: int, cost: int, limit: int) -> bool:
    """Whether a window holding ``count`` requests takes ``cost`` more: integers, exact."""
    return count + cost <= limit


def count_result(op: CountOp, allowed: bool, count: float, committed: bool) -> OpResult:
    """The answer for ``op`` from the window's count before the request."""
    after = int(count) + op.cost if committed else int(count)
    return OpResult(allowed, float(max(0, op.limit - after)), 0.0 if allowed else op.reset, op.reset)


# --------------------------------------------------------------------------- quota grants
# ``consistency: batched`` for a quota: a grant adds up to ``want`` units to the window's
# count at once, when the count admits the asking request (:func:`count_admits` for its
# cost), so the window never counts fewer than were admitted and no more than ``limit``
# are admitted; unspent units go back with :func:`quota_give_back`. Integers, exact.


def quota_pool(count: int, held: int) -> int:
    """The window's count with the asking replica's ``held`` remainder given back."""
    return quota_give_back(count, held)


def quota_grant_size(pool: int, want: int, limit: int) -> int:
    """Units a grant adds to a count of ``pool`` that admits it: ``want``, or what is left
    of ``limit`` when less (at least the asking request's cost)."""
    return max(0, min(want, limit - pool))


def quota_give_back(count: int, amount: int) -> int:
    """The window's count after ``amount`` unspent granted units come back: never below 0."""
    return max(0, count - amount)


def quota_grant_result(op: QuotaGrantOp, allowed: bool, count: float, committed: bool) -> OpResult:
    """The answer for a quota grant from the window's count before it: ``remaining`` is
    what the window has left after it; ``retry_after`` the seconds to the window's end
    (allowed or not: the grant belongs to that window); ``extra`` the units granted (> 0),
    or minus the ``held`` units that stay with the replica when nothing was committed (<= 0)."""
    pool = quota_pool(int(count), op.held)
    retry = op.reset  # allowed too: the window the grant belongs to (the limiter keys it)
    if not committed:
        return OpResult(allowed, float(max(0, op.limit - pool)), retry, float(-op.held))
    granted = quota_grant_size(pool, op.want, op.limit)
    return OpResult(allowed, float(max(0, op.limit - pool - granted)), retry, float(granted))


def quota_return_result(op: QuotaReturnOp, allowed: bool, count: float, committed: bool) -> OpResult:
    """The answer for a quota give-back (always allowed): ``remaining`` is the window's count
    after it."""
    return OpResult(True, float(quota_give_back(int(count), op.amount)), 0.0, 0.0)


# --------------------------------------------------------------------------- fleet grants
# ``consistency: batched`` for fleet_usage: a replica's grant is ``have`` members of the
# fleet's lease ZSET (each a slot with an expiry score, renewed while held), ``used`` of
# them by requests in flight there. The store counts the live leases of the others
# (``others``: every live member but the grant's own, so it is the same whether the
# grant's members are live or expired). The grant after an op keeps the slots in use
# (``used``: restored when they expired while the replica stood still, past ``limit`` if
# others took them meanwhile: those requests are in flight, and the others must see them),
# and never holds free slots past what is left of ``limit``; a growth allows only when a
# free slot is there for the asking request. So the members never exceed what exact leases
# would, and a replica admits a request only into a slot of its grant.


def fleet_grant_target(op: FleetGrantOp) -> int:
    """The size the op asks for: ``have + want`` (never below 0)."""
    return max(0, op.have + op.want)


def fleet_grant_top(others: int, op: FleetGrantOp, committed: bool) -> int:
    """The grant's size after the op, from the live leases of the others: the size asked
    (:func:`fleet_grant_target`), at most what is left of ``limit`` (``limit`` 0, count only:
    as asked), but never below the slots in use (``min(used, have)``); ``have`` when nothing
    was committed."""
    if not committed:
        return op.have
    target = fleet_grant_target(op)
    if op.limit <= 0:
        return target
    return max(min(op.used, op.have), min(target, op.limit - others))


def fleet_grant_admits(others: int, op: FleetGrantOp) -> bool:
    """Whether a fleet grant op allows: a growth when the grant after it has a free slot for
    the asking request, a renewal or shrink (``want <= 0``) always."""
    return op.want <= 0 or fleet_grant_top(others, op, True) > min(op.used, op.have)


def fleet_grant_over(others: int, top: int, limit: int) -> int:
    """Leases past ``limit`` once the grant holds ``top`` slots (0 for count only): what the
    store can tell of admissions past the exact limiter's count (a grant's slots in use
    restored after others took them)."""
    return 0 if limit <= 0 else max(0, others + top - limit)


def fleet_grant_result(op: FleetGrantOp, allowed: bool, live: float, committed: bool) -> OpResult:
    """The answer for a fleet grant from the others' live leases before it: ``remaining`` the
    free slots of ``limit`` after it (inf for count only); ``extra`` the grant's size after
    it, or -1 when nothing was committed (the grant stands as it was: not renewed);
    ``retry_after`` the leases past ``limit`` after it (:func:`fleet_grant_over`)."""
    others = int(live)
    if not committed:
        free = float(op.limit - others - op.have) if op.limit > 0 else float("inf")
        return OpResult(allowed, max(0.0, free), 0.0, -1.0)
    top = fleet_grant_top(others, op, committed)
    free = float(op.limit - others - top) if op.limit > 0 else float("inf")
    return OpResult(allowed, max(0.0, free), float(fleet_grant_over(others, top, op.limit)), float(top))


# --------------------------------------------------------------------------- ledger slices
# The rate limit quota service's ledger across replicas (``SliceOp``, docs/rlqs.md): a ledger
# key holds per holder a slice of whole units of one number (a limiter's tokens per fill
# interval, or its burst) under an expiry. The store reads the live slices of the others
# (``others``: every live slice but the holder's own, so it is the same whether the
# holder's own slice is live or expired) and sets the holder's to what it asks, or to what
# is left of ``total``: the live slices never sum past ``total`` by a slice taken here (a
# lowered ``total`` shrinks only the slices renewed after it). Integers, exact.


def slice_live(expires_at: float, now: float) -> bool:
    """A slice is live strictly before its expiry (:func:`lease_live`'s rule)."""
    return lease_live(expires_at, now)


def slice_top(others: int, op: SliceOp) -> int:
    """The holder's slice after the op, from the others' live slices: ``want``, or what is
    left of ``total`` when less, never below 0 (0: the slice is returned)."""
    return max(0, min(op.want, op.total - others))


def slice_over(others: int, top: int, total: int) -> int:
    """Units the ledger holds past ``total`` once the holder holds ``top`` (the others'
    slices taken under a larger total, until they are renewed or expire)."""
    return max(0, others + top - total)


def slice_result(op: SliceOp, allowed: bool, others: float, committed: bool) -> OpResult:
    """The answer for a slice from the others' live slices before it: ``remaining`` the
    units of ``total`` no holder holds after it; ``extra`` the holder's slice after it, or
    -1 when nothing was committed (the slice stands as it was: not renewed);
    ``retry_after`` the units held past ``total`` after it (:func:`slice_over`)."""
    held = int(others)
    top = slice_top(held, op) if committed else 0
    free = float(max(0, op.total - held - top))
    return OpResult(allowed, free, float(slice_over(held, top, op.total)), float(top) if committed else -1.0)


# --------------------------------------------------------------------------- the op table
# One rule per op kind (:data:`RULES`, a row for every kind of ``base.OP_KINDS``): what state
# the op reads, whether it allows from that state, the state its commit leaves and the
# answer. The memory store evaluates every op of a check with it and commits by it; Redis's
# ``check.lua`` runs the same admits and commit (its branch for the op's ``CODE``) and
# returns the state read, from which the wire derives the answers with ``result`` as the
# memory store does; the Cluster's compensation gives back ``refund``.

#: the states an op reads (and its commit writes), one value each, as both stores keep them:
#: a token bucket's tokens refilled to now (the op has ``rate`` and ``burst``); a quota
#: window's count (0 when there is none); a lease set's live leases after the sweep; a fleet
#: key's live leases other than the op's grant's members (``FleetGrantOp``); a ledger's live
#: slices other than the op's holder's, summed (``SliceOp``)
State = Literal["tokens", "count", "leases", "slots", "slices"]
TOKENS: Final = "tokens"
COUNT: Final = "count"
LEASES: Final = "leases"
SLOTS: Final = "slots"
SLICES: Final = "slices"

K = TypeVar("K")


class TokensOp(Protocol):
    """What an op reading :data:`TOKENS` carries: its bucket and the bucket's numbers."""

    @property
    def key(self) -> str: ...
    @property
    def rate(self) -> float: ...
    @property
    def burst(self) -> float: ...


def stamp_now(now: float, last: float | None) -> float:
    """The time an exact bucket op stores with its tokens: ``now`` (``check.lua``'s "b")."""
    return now


@dataclass(frozen=True)  # no slots: ``Rule[BucketOp](...)`` sets __orig_class__
class Rule(Generic[K]):
    """How ops of one kind are evaluated and committed, from ``value``: the op's state
    before the request (:data:`State`) as a float, exactly as both stores read it."""

    #: what the op reads and its commit writes
    state: State
    #: whether the op allows, on its own
    admits: Callable[[K, float], bool]
    #: the state after the op commits (tokens left, the window's count, live leases, the
    #: grant's size); the stores write it
    commit: Callable[[K, float], float]
    #: the answer: (op, allowed, value, committed) -> OpResult
    result: Callable[[K, bool, float, bool], OpResult]
    #: Redis Cluster: what a committed op gives back when another slot group refused its
    #: request (tokens, units; a lease: its lease id, the amount unused), from ``value``;
    #: None: nothing (a give-back is sent alone and always allows; a fleet grant's slots
    #: expire with their TTL)
    refund: Callable[[K, float], float] | None = None
    #: tokens: the time stored with the tokens, from now and the stored one
    #: (:func:`grant_stamp` for grants and give-backs)
    stamp: Callable[[float, float | None], float] = stamp_now
    #: count: whether a commit into a window that is gone starts a new count (a give-back
    #: does not: it carries no limit or TTL)
    creates: bool = True
    #: an answer that never came (the call may have run, :data:`extauthz.store.redis.wire.UNKNOWN`)
    #: is taken as committed: only where undoing what was not done is harmless (a lease:
    #: releasing a lease id that is not there); elsewhere as not committed (refunding what
    #: was not taken would admit more)
    assume_committed: bool = False
    #: batched grants: what the op gives back of a replica's grant (a give-back's amount, a
    #: grant's remainder ``held``), counted by the grant book; None: nothing
    gives_back: Callable[[K], float] | None = None
    #: a give-back, sent with no request (always allows): it rides with the next check, as
    #: releases do (the Redis store)
    rides: bool = False


def _grant_taken(op: GrantOp, tokens: float) -> float:
    """The tokens a committed grant takes from the bucket's ``tokens``."""
    return grant_size(grant_pool(tokens, op.held, op.burst), op.want)


def _quota_granted(op: QuotaGrantOp, count: float) -> int:
    """The units a committed quota grant adds to the window's ``count``."""
    return quota_grant_size(quota_pool(int(count), op.held), op.want, op.limit)


#: op kind -> its rule
RULES: Final[dict[type[Op], Rule[Any]]] = {
    BucketOp: Rule[BucketOp](
        TOKENS,
        admits=lambda op, tokens: admits(tokens, op.cost),
        commit=lambda op, tokens: take(tokens, op.cost),
        result=bucket_result,
        refund=lambda op, tokens: op.cost,
    ),
    GrantOp: Rule[GrantOp](
        TOKENS,
        admits=lambda op, tokens: admits(grant_pool(tokens, op.held, op.burst), op.cost),
        commit=lambda op, tokens: take(grant_pool(tokens, op.held, op.burst), _grant_taken(op, tokens)),
        result=grant_result,
        # the grant taken, less the remainder it brought (the replica keeps that: the
        # answer is "not committed"); granted >= cost > held
        refund=lambda op, tokens: max(0.0, _grant_taken(op, tokens) - op.held),
        stamp=grant_stamp,
        gives_back=lambda op: op.held,
    ),
    ReturnOp: Rule[ReturnOp](
        TOKENS,
        admits=lambda op, tokens: True,
        commit=lambda op, tokens: give_back(tokens, op.amount, op.burst),
        result=return_result,
        stamp=grant_stamp,
        gives_back=lambda op: op.amount,
        rides=True,
    ),
    CountOp: Rule[CountOp](
        COUNT,
        admits=lambda op, count: count_admits(int(count), op.cost, op.limit),
        commit=lambda op, count: float(int(count) + op.cost),
        result=count_result,
        refund=lambda op, count: op.cost,
    ),
    QuotaGrantOp: Rule[QuotaGrantOp](
        COUNT,
        admits=lambda op, count: count_admits(quota_pool(int(count), op.held), op.cost, op.limit),
        commit=lambda op, count: float(quota_pool(int(count), op.held) + _quota_granted(op, count)),
        result=quota_grant_result,
        # what the grant added to the count, less the remainder it brought back
        refund=lambda op, count: max(0, _quota_granted(op, count) - op.held),
        gives_back=lambda op: float(op.held),
    ),
    QuotaReturnOp: Rule[QuotaReturnOp](
        COUNT,
        admits=lambda op, count: True,
        commit=lambda op, count: float(quota_give_back(int(count), op.amount)),
        result=quota_return_result,
        creates=False,
        gives_back=lambda op: float(op.amount),
        rides=True,
    ),
    LeaseOp: Rule[LeaseOp](
        LEASES,
        admits=lambda op, live: lease_admits(int(live), op.limit),
        commit=lambda op, live: live + 1,
        result=lease_result,
        refund=lambda op, live: 1.0,
        assume_committed=True,
    ),
    FleetGrantOp: Rule[FleetGrantOp](
        SLOTS,
        admits=lambda op, others: fleet_grant_admits(int(others), op),
        commit=lambda op, others: float(fleet_grant_top(int(others), op, True)),
        result=fleet_grant_result,
    ),
    SliceOp: Rule[SliceOp](
        SLICES,
        admits=lambda op, others: True,
        commit=lambda op, others: float(slice_top(int(others), op)),
        result=slice_result,
    ),
}


def given_back(op: Op) -> float:
    """What ``op`` gives back of a replica's batched grant (:attr:`Rule.gives_back`; 0: nothing)."""
    gives_back = RULES[type(op)].gives_back
    return 0.0 if gives_back is None else gives_back(op)


def rides(ops: Sequence[Op]) -> bool:
    """Whether ``ops`` are give-backs only (:attr:`Rule.rides`): sent with the next check."""
    return all(RULES[type(op)].rides for op in ops)


# --------------------------------------------------------------------------- shed controller


def clamp(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


def shed_derivative(utilization: float, p: ShedParams) -> float:
    """Level change per second for a utilization sample (the gist's derivative): below
    ``good_below`` it falls, proportionally to how far below; up to ``bad_above`` it holds
    (the dead zone); above it rises; at most ``1 / time_to_shed_all`` per second."""
    if utilization < p.good_below:
        amount = utilization / p.good_below - 1.0
    elif utilization < p.bad_above:
        amount = 0.0
    else:
        amount = (utilization - p.bad_above) / (1.0 - p.bad_above)
    return clamp(amount, -1.0, 1.0) / p.time_to_shed_all


def shed_advance(level: float | None, last: float | None, now: float, utilization: float,
                 p: ShedParams) -> float:
    """The shed level after a sample taken at ``now``, from the state ``(level, last)``
    left by the previous sample. A new controller (no state) starts at rest. The elapsed
    time is clamped to ``[0, delay_before_shedding]`` so a long pause cannot jump the level."""
    if level is None or last is None:
        return p.resting
    elapsed = clamp(now - last, 0.0, p.delay_before_shedding)
    return clamp(level + elapsed * shed_derivative(utilization, p), p.resting, 1.0)
