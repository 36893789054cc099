"""Envoy's rate limit service protocol (``envoy.service.ratelimit.v3.RateLimitService/
ShouldRateLimit``), the ratelimit filter's door to the check flow.

One ``RateLimitRequest`` is a domain and a list of descriptors. The policy's descriptor table
(:mod:`extauthz.policy.descriptors`) names the one limiter each descriptor reaches, with
``replaces`` applied across them, as envoyproxy/ratelimit does; each descriptor that reaches
a limiter then goes through the check flow (:class:`~extauthz.server.flow.CheckFlow`: the
same classifier, engine, store, fail-open and shadow handling as ``Check``) as one request
whose context carries the descriptor's entries and its target (only that limiter applies).
A descriptor that reaches nothing (an unknown domain or shape) is answered OK and counted
(:attr:`RateLimitDoor.unknown`); an ``unlimited`` one is answered OK with no limit.

The answer, as envoyproxy/ratelimit's: ``overall_code`` OVER_LIMIT when a descriptor is
over its limit (a shadow limiter never is: counted as would-refuse), one ``DescriptorStatus``
per descriptor (``current_limit``, ``limit_remaining``, ``duration_until_reset``), and the
``RateLimit-Policy``/``RateLimit`` headers (and ``Retry-After`` when over) of the descriptor
closest to its limit, which the filter adds to the response; or, as the policy's
``ratelimit_headers`` says, envoyproxy/ratelimit's ``LIMIT_RESPONSE_HEADERS_ENABLED`` three
(limit, remaining, reset, under names of the policy's choosing), or none.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from ..core.context import RawRequest, RequestContext
from ..core.verdict import Decision, Limits, Outcome, Verdict
from ..engine.answers import held_lease_fields, ratelimit_headers, retry_after_seconds
from ..engine.engine import Snapshot
from ..engine.state import Section
from ..policy.descriptors import Entries, ResponseHeaders, replaced
from ..policy.schema import MAX_COUNT, QuotaSpec, RequestRateSpec
from ..proto import core_pb2, rls_pb2
from .flow import CheckFlow
from .grpc_h2 import call_time_left
from .leases import Leases

_RPC = {"rpc.system": "grpc", "rpc.service": "envoy.service.ratelimit.v3.RateLimitService",
        "rpc.method": "ShouldRateLimit"}
_OK = rls_pb2.RateLimitResponse.OK
_OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
_Unit = rls_pb2.RateLimitResponse.RateLimit
#: a quota's period -> the response's unit
UNITS = {"second": _Unit.SECOND, "minute": _Unit.MINUTE, "hour": _Unit.HOUR, "day": _Unit.DAY,
         "week": _Unit.WEEK, "month": _Unit.MONTH, "year": _Unit.YEAR}
#: a token bucket's rate, told in the first unit in which it is at least one request
_RATE_UNITS = ((_Unit.SECOND, 1), (_Unit.MINUTE, 60), (_Unit.HOUR, 3600), (_Unit.DAY, 86400))
_MAX_UINT32 = 2**32 - 1
#: descriptors one ``RateLimitRequest`` may carry (Envoy sends one per rate limit action that
#: applies to the route, a handful); more is refused with INVALID_ARGUMENT, as a request without
#: a domain is: each matched descriptor is a decision and a store call, and a 4 MiB message
#: holds a hundred thousand descriptors.
MAX_DESCRIPTORS = 64
#: distinct descriptor values a ``detailed_metric`` limiter is counted by; the rest: ``other``
MAX_DETAILED_VALUES = 100
#: hex characters of a value's keyed hash its label keeps
DETAILED_HASH_CHARS = 12
#: the response's unit -> a quota's period
PERIODS = {unit: period for period, unit in UNITS.items()}


def limit_of(limit: Any, spec: Any) -> int | None:
    """What a descriptor's own ``limit`` (Envoy's override, ``requests_per_unit`` per ``unit``)
    sets, or None when it is not applied: applied to a ``quota`` whose ``period`` is its
    unit (the count is the same, only its limit changes), bounded by :data:`MAX_COUNT`;
    anything else (another unit, a token bucket, a lease limiter) is ignored (counted:
    ``extauthz_ratelimit_limit_overrides_total{result="ignored"}``), the policy decides."""
    if isinstance(spec, QuotaSpec) and PERIODS.get(limit.unit) == spec.period:
        return min(int(limit.requests_per_unit), MAX_COUNT)
    return None


@dataclass(frozen=True, slots=True)
class DescriptorCall:
    """One descriptor of a ``RateLimitRequest`` that reached a limiter: what the door reads."""

    #: the entries (values may be API keys: never in a repr, a log or a span)
    entries: Mapping[str, str] = field(repr=False)
    #: the limiter's name
    target: str
    #: the hits it adds (``hits_addend``): None for the limiter's own cost, 0 to check only
    hits: int | None
    #: the request's lease id, shared by its descriptors ("": the policy takes no leases)
    lease_id: str = ""
    #: the descriptor's ``limit`` applied to its quota (requests per unit), else None
    limit: int | None = None


def hits_of(request: rls_pb2.RateLimitRequest, descriptor: Any) -> int | None:
    """The hits one descriptor adds, as envoyproxy/ratelimit's ``GetHitsAddends``: its own
    ``hits_addend`` when set (0: checked, nothing added), else the request's when not 0, else
    None (the limiter's ``cost``, one hit by default); bounded at one past :data:`MAX_COUNT`
    (over any limit, the largest too)."""
    if descriptor.HasField("hits_addend"):
        hits = descriptor.hits_addend.value
    elif request.hits_addend:
        hits = request.hits_addend
    else:
        return None
    return min(int(hits), MAX_COUNT + 1)


def current_limit(spec: Any) -> rls_pb2.RateLimitResponse.RateLimit | None:
    """A limiter's numbers as the response's ``current_limit`` (a bucket's rate in the first
    unit that holds one request)."""
    if isinstance(spec, QuotaSpec):
        return _Unit(name=spec.name, requests_per_unit=min(spec.limit, _MAX_UINT32), unit=UNITS[spec.period])
    if isinstance(spec, RequestRateSpec):
        for unit, seconds in _RATE_UNITS:
            if spec.rate * seconds >= 1 or unit == _Unit.DAY:
                return _Unit(name=spec.name, requests_per_unit=min(math.floor(spec.rate * seconds), _MAX_UINT32),
                             unit=unit)
    return None


def _status(v: Verdict | None, decision: Decision, limit: Any) -> rls_pb2.RateLimitResponse.DescriptorStatus:
    """One decided descriptor's status. Its ``current_limit`` only beside a count the store
    gave (``limit_remaining``): a limiter that failed open or closed (the store down) counted
    nothing, and a limit with ``limit_remaining`` 0 beside it would tell the client it is out
    (the ``counts`` headers, Envoy's own ``enable_x_ratelimit_headers`` read the statuses);
    envoyproxy/ratelimit answers no status at all then (the call fails)."""
    status = rls_pb2.RateLimitResponse.DescriptorStatus(code=_OK if decision.allowed else _OVER)
    if v is not None and v.remaining is not None:
        if limit is not None:
            status.current_limit.CopyFrom(limit)
        status.limit_remaining = max(0, min(math.floor(v.remaining), _MAX_UINT32))
    if v is not None:
        reset = v.retry_after if v.outcome is Outcome.DENIED and v.retry_after else v.reset
        if reset is not None and reset > 0:
            status.duration_until_reset.FromNanoseconds(math.ceil(reset * 1e9))
    return status


@dataclass(frozen=True, slots=True)
class Answer:
    """One descriptor's answer: its status and the decision behind it (None: no limiter)."""

    status: rls_pb2.RateLimitResponse.DescriptorStatus
    decision: Decision | None = None


_IETF = ResponseHeaders()
_NO_LIMIT = Answer(rls_pb2.RateLimitResponse.DescriptorStatus(code=_OK))
_UNLIMITED = Answer(rls_pb2.RateLimitResponse.DescriptorStatus(code=_OK, limit_remaining=_MAX_UINT32))


class RateLimitDoor:
    """The check flow's door for one descriptor (a :class:`~extauthz.server.flow.Door`):
    :class:`DescriptorCall` in, :class:`Answer` out; and :meth:`should_rate_limit`, the
    whole request."""

    name = "ratelimit"
    what = "a rate limit descriptor"
    span = _RPC

    def __init__(self, flow: CheckFlow) -> None:
        self.flow = flow
        #: descriptors that reached no limiter (unknown domain or shape): answered OK
        self.unknown = 0
        #: descriptors an ``unlimited`` entry answered
        self.unlimited = 0
        #: descriptors a limiter decided
        self.decided = 0
        #: descriptors whose limiter another descriptor's ``replaces`` switched off
        self.replaced = 0
        #: descriptors' own ``limit`` by what became of it (:func:`limit_of`)
        self.overrides: dict[str, int] = {"applied": 0, "ignored": 0}
        #: ``detailed_metric`` limiters' decisions per descriptor value (a bounded label):
        #: (limiter, value label, code) -> descriptors
        self.detailed: dict[tuple[str, str, str], int] = {}
        self._detailed_values: dict[str, set[str]] = {}
        #: descriptors of requests refused unread (no domain, more than :data:`MAX_DESCRIPTORS`)
        self.refused = 0

    def counts(self) -> dict[str, int]:
        """Descriptors by what answered them (``extauthz_ratelimit_descriptors_total{result}``)."""
        return {"decided": self.decided, "refused": self.refused, "replaced": self.replaced,
                "unknown": self.unknown, "unlimited": self.unlimited}

    async def should_rate_limit(self, request: rls_pb2.RateLimitRequest,
                                context: grpc.aio.ServicerContext) -> rls_pb2.RateLimitResponse:
        problem = refusal(request)
        if problem is not None:
            self.refused += len(request.descriptors)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        snap = self.flow.engine.snapshot
        descriptors: list[Entries] = [tuple([(e.key, e.value) for e in d.entries]) for d in request.descriptors]
        table = snap.policy.descriptors
        found = [table.lookup(request.domain, entries) for entries in descriptors]
        targets = replaced(found)
        # one lease id for the request's descriptors: their leases travel in one metadata
        lease_id = os.urandom(8).hex() if snap.policy.longest_lease_ttl else ""
        answers: list[Answer] = []
        for d, entries, was, target in zip(request.descriptors, descriptors, found, targets, strict=True):
            if target is None:
                if was is None:
                    self.unknown += 1
                else:
                    self.replaced += 1
                answers.append(_NO_LIMIT)
            elif target.unlimited:
                self.unlimited += 1
                answers.append(_UNLIMITED)
            else:
                self.decided += 1
                limit = None
                if d.HasField("limit"):
                    limit = limit_of(d.limit, snap.policy.limiter(target.name))
                    self.overrides["ignored" if limit is None else "applied"] += 1
                answers.append(await self.flow.check(
                    self, DescriptorCall(dict(entries), target.name, hits_of(request, d), lease_id, limit), context))
        resp = response(answers, snap.policy.ratelimit_headers)
        if lease_id:
            self._leases(resp, lease_id, [a.decision for a in answers if a.decision is not None and a.decision.leases])
        return resp

    def _leases(self, resp: rls_pb2.RateLimitResponse, lease_id: str, held: list[Decision]) -> None:
        """The leases the descriptors' decisions hold, in the response's dynamic metadata (the
        filter files it under its namespace, the access log hands it back when the request
        finishes); given back at once when the answer refuses the request (nothing goes on)."""
        if not held:
            return
        leases = self.flow.leases
        if resp.overall_code == _OVER:
            for decision in held:
                leases.abandoned(decision)
            return
        keys = tuple(k for decision in held for k in decision.leases)
        resp.dynamic_metadata.update(dict(held_lease_fields(lease_id, keys, leases.tickets.make(lease_id, keys))))

    # -- the Door: one descriptor in, its answer out
    def read(self, message: DescriptorCall, snap: Snapshot) -> RawRequest:
        return RawRequest("", "", descriptor=message.entries, descriptor_target=message.target,
                          hits=message.hits, lease_id=message.lease_id,
                          descriptor_limits=None if message.limit is None else Limits(limit=message.limit))

    def hold(self, message: DescriptorCall, call: grpc.aio.ServicerContext, ctx: RequestContext,
             decision: Decision, leases: Leases) -> str | None:
        # the leases travel in the whole request's answer (should_rate_limit); Envoy may give
        # up on the call (the filter's timeout): then they never reach the access log
        call.add_done_callback(lambda c: leases.abandoned(decision) if c.cancelled() else None)
        return ""  # the request is not seen: no request id (the metadata alone releases)

    def answer(self, message: DescriptorCall, ctx: RequestContext, decision: Decision,
               ticket: str) -> Answer:
        v = next((v for v in decision.verdicts if v.limiter == message.target), None)
        policy = self.flow.engine.snapshot.policy
        spec = policy.limiter(message.target)
        limit = current_limit(spec)
        if limit is not None and message.limit is not None:  # the descriptor's own, applied
            limit.requests_per_unit = message.limit
        status = _status(v, decision, limit)
        if getattr(spec, "detailed_metric", False):
            self._count_detailed(message.target, ctx, policy.key_index.get(message.target), status.code)
        return Answer(status, decision)

    def _count_detailed(self, name: str, ctx: RequestContext, index: int | None, code: int) -> None:
        """One ``detailed_metric`` decision, by the descriptor value's label: its keyed hash,
        cut (never the raw value: an API key), for the first :data:`MAX_DETAILED_VALUES` values
        of the limiter; ``other`` for the rest."""
        value = ctx.keys[index][0][:DETAILED_HASH_CHARS] if index is not None else ctx.identity[:DETAILED_HASH_CHARS]
        seen = self._detailed_values.setdefault(name, set())
        if value not in seen:
            if len(seen) >= MAX_DETAILED_VALUES:
                value = "other"
            else:
                seen.add(value)
        k = (name, value, "over_limit" if code == _OVER else "ok")
        self.detailed[k] = self.detailed.get(k, 0) + 1

    def time_left(self, message: DescriptorCall,
                  call: grpc.aio.ServicerContext) -> tuple[float | None, float, bool]:
        return call_time_left(call)

    def unreadable(self, message: DescriptorCall) -> Answer:
        return _NO_LIMIT

    def carrier(self, message: DescriptorCall, call: grpc.aio.ServicerContext) -> Iterable[tuple[str, Any]]:
        return call.invocation_metadata() or ()


def refusal(request: rls_pb2.RateLimitRequest) -> str | None:
    """Why ``request`` is refused unread (envoyproxy/ratelimit refuses an empty domain too),
    or None."""
    if not request.domain:
        return "rate limit domain must not be empty"
    if len(request.descriptors) > MAX_DESCRIPTORS:
        return f"{len(request.descriptors)} descriptors: at most {MAX_DESCRIPTORS} in one request"
    return None


def response(answers: list[Answer], headers: ResponseHeaders = _IETF) -> rls_pb2.RateLimitResponse:
    """The ``RateLimitResponse`` of the descriptors' answers: OVER_LIMIT when one is; the
    rate limit headers (``headers``, the policy's ``ratelimit_headers``) of the one over its
    limit, else of the one closest to it."""
    over = next((a for a in answers if a.status.code == _OVER), None)
    resp = rls_pb2.RateLimitResponse(overall_code=_OVER if over is not None else _OK,
                                     statuses=[a.status for a in answers])
    if headers.style == "counts":
        resp.response_headers_to_add.extend(count_headers(answers, headers))
        return resp
    if headers.style == "none":
        return resp
    shown = over or min((a for a in answers if a.decision is not None and a.status.HasField("current_limit")),
                        key=lambda a: a.status.limit_remaining, default=None)
    if shown is not None and shown.decision is not None:
        found = ratelimit_headers(shown.decision)
        denied = shown.decision.denied_by
        if denied is not None:
            found.append(("retry-after", str(retry_after_seconds(denied))))
        resp.response_headers_to_add.extend([core_pb2.HeaderValue(key=k, value=v) for k, v in found])
    return resp


def count_headers(answers: list[Answer], headers: ResponseHeaders) -> list[core_pb2.HeaderValue]:
    """envoyproxy/ratelimit's ``LIMIT_RESPONSE_HEADERS_ENABLED`` headers: of the descriptors
    with a ``current_limit``, the last one over its limit (the peer's loop keeps the last),
    else the first with the least left: its limit (requests per unit), what is left, and the
    whole seconds until its window ends (the status's ``duration_until_reset``, rounded up; 0
    without one). None when no descriptor has a limit (unknown, unlimited, a shedder's, one
    whose store failed), as the peer's, or when the answer refuses and none of those with a
    limit is over it."""
    limited = [a.status for a in answers if a.status.HasField("current_limit")]
    if not limited:
        return []
    over = [s for s in limited if s.code == _OVER]
    if not over and any(a.status.code == _OVER for a in answers):
        # refused by a descriptor with no count to tell (concurrent_requests, a shedder, a
        # store failed closed): an allowing one's figures would say the client has some left;
        # the peer's headers on an OVER_LIMIT answer are always an over descriptor's
        return []
    shown = over[-1] if over else min(limited, key=lambda s: s.limit_remaining)
    reset = math.ceil(shown.duration_until_reset.ToNanoseconds() / 1e9) if shown.HasField(
        "duration_until_reset") else 0
    return [core_pb2.HeaderValue(key=headers.limit, value=str(shown.current_limit.requests_per_unit)),
            core_pb2.HeaderValue(key=headers.remaining, value=str(shown.limit_remaining)),
            core_pb2.HeaderValue(key=headers.reset, value=str(reset))]


def detailed_part(door: RateLimitDoor) -> Section:
    """``detailed_metric`` limiters' decisions per descriptor value: ``/status``
    ``ratelimit_detailed`` and ``extauthz_ratelimit_detailed_total{limiter, value, code}``
    (``value``: a keyed hash's first characters, at most :data:`MAX_DETAILED_VALUES` per
    limiter, then ``other``)."""
    def status() -> Mapping[str, Any]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (name, value, code), n in sorted(door.detailed.items()):
            out.setdefault(name, {}).setdefault(value, {})[code] = n
        return {"ratelimit_detailed": out}

    def metrics() -> Iterator[Metric]:
        family = CounterMetricFamily(
            "extauthz_ratelimit_detailed", "Decisions of detailed_metric limiters (ShouldRateLimit) per "
            "descriptor value (a keyed hash's first characters; past the first values: other).",
            labels=["limiter", "value", "code"])
        for (name, value, code), n in sorted(door.detailed.items()):
            family.add_metric([name, value, code], n)
        yield family

    return Section(status, metrics)
