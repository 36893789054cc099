"""The limiter contract. One module per limiter kind implements it.

A limiter may decide locally (:meth:`Limiter.local`, e.g. the worker utilization shedder
drawing against its shed level) and/or contribute one store operation
(:meth:`Limiter.op`) whose result it turns into a verdict (:meth:`Limiter.verdict`).
The engine batches every limiter's op into one atomic store call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ..core.context import RequestContext
from ..core.tiers import Tier
from ..core.verdict import Kind, Limits, Outcome, Verdict
from ..policy.model import Matcher, compile_match
from ..policy.schema import PLAN_NUMBERS, LimiterSpec, not_fields
from ..store.base import Op, OpResult
from ..store.keys import Keys

#: Retry-After of a request refused because the server was starved (s): a loop stall or a
#: CPU taken away is over in seconds, or shedding goes on
OVERLOAD_RETRY_AFTER = 1.0


class GrantHolder(Protocol):
    """What the engine's grant book (:class:`~extauthz.limiters.grants.GrantBook`), status
    and metrics use of a limiter's batched grants: :class:`~extauthz.limiters.grants.GrantTable`
    and fleet_usage's :class:`~extauthz.limiters.fleet.FleetSlots`."""

    def status(self) -> dict[str, float]: ...

    def early_refusals(self) -> tuple[list[tuple[str, float]], float]: ...

    async def settle(self) -> None: ...

    def retire(self) -> None: ...

    def release(self, key: str, lease_id: str) -> bool: ...

    @property
    def done(self) -> bool: ...


class Limiter(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def grants(self) -> GrantHolder | None:
        """Its batched grants (``consistency: batched``), else None."""

    @property
    def holds_leases(self) -> bool:
        """Whether an admitted request may hold a lease in a local grant (:meth:`hold`)."""

    @property
    def kind(self) -> Kind: ...

    @property
    def failure_mode(self) -> str:
        """``open`` (allow when the store fails) or ``closed`` (503)."""

    @property
    def applies_to(self) -> Matcher: ...

    def key_missing(self, ctx: RequestContext) -> bool:
        """True when a part of this limiter's key yields nothing for ``ctx`` (and the
        limiter skips such requests): it does not apply (``key_missing``)."""

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        """A verdict reached without the store, or None."""

    def op(self, ctx: RequestContext, enforce: bool) -> Op | None:
        """The store operation for this request, or None."""

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        """Turn the store's answer to :meth:`op` into a verdict."""

    def override(self, numbers: Mapping[str, float]) -> Mapping[str, Limits]:
        """A live per-customer override's numbers, by plan (``""``: a plan the limiter does
        not list). ValueError (the reason, for the operator) when the numbers do not fit, or
        when the limiter takes no override (a fleet-wide shedder)."""

    def refund(self, ctx: RequestContext) -> None:
        """Give back, to this replica's grant, what :meth:`local` spent for ``ctx`` (a
        request another limiter refused)."""

    def hold(self, ctx: RequestContext, lease_id: str) -> str | None:
        """The lease key of the slot an admitted request took from a local grant (its lease
        named ``lease_id``), or None."""


class LimiterBase:
    """What every limiter kind reads from its policy entry first: its name, its failure
    mode and what it applies to (compiled); and no batched grants unless the kind takes
    them (``grants``, ``holds_leases``, :meth:`refund`, :meth:`hold`)."""

    grants: GrantHolder | None = None
    holds_leases = False

    def refund(self, ctx: RequestContext) -> None:
        return None

    def hold(self, ctx: RequestContext, lease_id: str) -> str | None:
        return None

    def __init__(self, spec: LimiterSpec) -> None:
        self.name = spec.name
        self.failure_mode = spec.failure_mode
        self.applies_to = compile_match(spec.applies_to, spec.name if spec.match is not None else None)


class PerCustomer(LimiterBase):
    """What the keyed, per-customer limiters (request_rate, concurrent_requests, quota)
    share: they count per :class:`KeyOf` (a request without the key skips them), with
    numbers per customer (:meth:`limits`), and decide in the store (no :meth:`local`
    verdict). Each kind sets ``own`` and ``plans`` and writes ``op``, ``verdict`` and
    ``override``."""

    kind = Kind.RATE_LIMITER
    #: the limiter's own numbers, and each plan's (validated at load)
    own: Limits
    plans: dict[str, Limits]

    def __init__(self, spec: LimiterSpec, keys: Keys, key: KeyOf) -> None:
        super().__init__(spec)
        self.key = key
        self._keys = keys

    def limits(self, ctx: RequestContext) -> Limits:
        """This customer's numbers: a live override (its numbers for the customer's plan, or
        ``""`` for a plan the limiter does not list), else the plan's, else the limiter's own.
        One or two dict lookups; everything was compiled before."""
        if ctx.overrides:
            by_plan = ctx.overrides.get(self.name)
            if by_plan is not None:
                return by_plan.get(ctx.plan) or by_plan[""]
        return self.plans.get(ctx.plan, self.own)

    def key_missing(self, ctx: RequestContext) -> bool:
        return self.key.of(ctx) is None

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        return None


class FleetWide(LimiterBase):
    """What the fleet-wide shedders (fleet_usage, worker_utilization) share: no key (every
    request they match applies) and no per-customer numbers."""

    kind = Kind.LOAD_SHEDDER

    def key_missing(self, ctx: RequestContext) -> bool:
        return False

    def override(self, numbers: Mapping[str, float]) -> dict[str, Limits]:
        raise ValueError(f"limiter '{self.name}' limits the whole fleet and takes no per-customer override")

    def overloaded(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        """The verdict while the server is starved (``extauthz.engine.overload``): a non-critical
        request is refused at once (503, reason ``overload``), without the store; None for a
        critical one, which goes on as usual (never refused here)."""
        if ctx.tier is Tier.CRITICAL:
            return None
        return Verdict(self.name, self.kind, denied_outcome(enforce), remaining=0.0,
                       retry_after=OVERLOAD_RETRY_AFTER, reason="overload",
                       detail=(f"The API is overloaded: the authorization server is starved and "
                               f"sheds {ctx.tier.value} traffic (load shedder '{self.name}'). "
                               f"Retry later with backoff."))


def override_limit(numbers: Mapping[str, float], kind: str) -> int:
    """The ``limit`` an override of a ``limit`` kind (concurrent_requests, quota) sets;
    ValueError naming the kind's fields for anything else."""
    unknown = sorted(set(numbers) - set(PLAN_NUMBERS[kind]))
    if unknown:
        raise ValueError(not_fields(unknown, kind))
    if "limit" not in numbers:
        raise ValueError(f"a {kind} override sets 'limit'")
    return int(numbers["limit"])


def denied_outcome(enforce: bool) -> Outcome:
    return Outcome.DENIED if enforce else Outcome.SHADOW_DENIED


def applies(matcher: Matcher, ctx: RequestContext) -> bool:
    return matcher.matches(ctx.method, ctx.path, ctx.host, ctx.headers, ctx.tier, ctx.descriptor_target)


class KeyOf:
    """What a limiter counts per: the identity (no ``key``, or ``[{identity: true}]``), or
    its key's value in ``RequestContext.keys`` (``Policy.key_index``). ``shared``
    (``on_missing_key: shared``): a request whose key is missing counts in the key's one
    shared bucket instead of skipping the limiter."""

    __slots__ = ("index", "shared")

    def __init__(self, index: int | None = None, shared: bool = False) -> None:
        self.index = index
        self.shared = shared

    def of(self, ctx: RequestContext) -> str | None:
        """The hashed key of ``ctx`` (a store-key identity), or None: the limiter skips it."""
        if self.index is None:
            return ctx.identity
        if self.index >= len(ctx.keys):  # a context classified for another policy
            return None
        value, missing = ctx.keys[self.index]
        return None if missing and not self.shared else value


#: counts per identity (today's behaviour without ``key``)
BY_IDENTITY = KeyOf()
