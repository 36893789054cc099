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


def denied_outcome(enforce: bool) -> Outcome:
    return Outcome.DENIED if enforce else Outcome.SHADOW_DENIED


def applies(matcher: Matcher, ctx: RequestContext) -> bool:
    return matcher.matches(ctx.method, ctx.path, ctx.host, ctx.headers, ctx.tier)
