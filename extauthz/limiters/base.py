"""The limiter contract. One module per limiter kind implements it.

A limiter may decide locally (:meth:`Limiter.local`, e.g. the worker utilization shedder
drawing against its shed level) and/or contribute one store operation
(:meth:`Limiter.op`) whose result it turns into a verdict (:meth:`Limiter.verdict`).
The engine batches every limiter's op into one atomic store call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ..context import RequestContext
from ..policy.model import Matcher
from ..policy.schema import PLAN_NUMBERS, not_fields
from ..store.base import Op, OpResult
from ..verdict import Kind, Limits, Outcome, Verdict


class Limiter(Protocol):
    @property
    def name(self) -> str: ...

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


def customer_limits(name: str, ctx: RequestContext, plans: Mapping[str, Limits], own: Limits) -> Limits:
    """One customer's numbers for limiter ``name``: a live override (its numbers for the
    customer's plan, or ``""`` for a plan the limiter does not list), else the plan's,
    else the limiter's own. One or two dict lookups; everything was compiled before."""
    if ctx.overrides:
        by_plan = ctx.overrides.get(name)
        if by_plan is not None:
            return by_plan.get(ctx.plan) or by_plan[""]
    return plans.get(ctx.plan, own)


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
    return matcher.matches(ctx.method, ctx.path, ctx.host, ctx.headers, ctx.tier)


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
