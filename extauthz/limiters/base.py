"""The limiter contract. One module per limiter kind implements it.

A limiter may decide locally (:meth:`Limiter.local`, e.g. the worker utilization shedder
drawing against its shed level) and/or contribute one store operation
(:meth:`Limiter.op`) whose result it turns into a verdict (:meth:`Limiter.verdict`).
The engine batches every limiter's op into one atomic store call.
"""

from __future__ import annotations

from typing import Protocol

from ..context import RequestContext
from ..policy.model import Matcher
from ..store.base import Op, OpResult
from ..verdict import Kind, Outcome, Verdict


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


def denied_outcome(enforce: bool) -> Outcome:
    return Outcome.DENIED if enforce else Outcome.SHADOW_DENIED


def applies(matcher: Matcher, ctx: RequestContext) -> bool:
    return matcher.matches(ctx.method, ctx.path, ctx.host, ctx.headers, ctx.tier)
