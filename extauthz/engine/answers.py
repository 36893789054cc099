"""What the client sees: status, headers and problem+json body for a decision.

Pure functions, no grpc. Header syntax follows the IETF httpapi ratelimit-headers draft
(``RateLimit-Policy: "name";q=500;w=5`` and ``RateLimit: "name";r=499;t=0``), with the
``qu="concurrent-requests"`` quota unit for in-flight limits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from ..core.context import RequestContext
from ..core.settings import PROTOCOLS as PROTOCOLS  # declared with the options
from ..core.verdict import Decision, Kind, Outcome, Quota, Verdict
from ..policy.schema import MAX_REFILL

PROBLEM_TYPE = "urn:extauthz:problem:"

_TITLES = {429: "Too Many Requests", 503: "Service Unavailable"}

#: the request's tier, sent to the upstream with an allowed request.
TIER_HEADER = "x-extauthz-tier"

#: Lease metadata: the fields an allowed check files in Envoy's dynamic metadata (namespace
#: ``envoy.filters.http.ext_authz``) for the access log to hand back. Header-shaped names
#: and string values, so that both edges file the same thing: the gRPC edge writes them as
#: Struct fields, the HTTP edge sends them as response headers that Envoy copies into the
#: same namespace (``authorization_response.dynamic_metadata_from_headers``).
LEASE_ID_FIELD = "x-extauthz-lease-id"
LEASES_FIELD = "x-extauthz-leases"
#: the lease ticket (a MAC over the lease id and keys) when the server makes one.
LEASE_TICKET_FIELD = "x-extauthz-lease-ticket"
LEASE_FIELDS = (LEASE_ID_FIELD, LEASES_FIELD, LEASE_TICKET_FIELD)
_LEASE_SEP = ","  # store keys never hold one (limiter and group names are [a-z0-9_.-])


def lease_fields(decision: Decision, ticket: str = "") -> list[tuple[str, str]]:
    """The lease metadata of an admitted decision (empty when it holds no lease), with its
    ``ticket`` when given: the ONE encoding both edges use; :func:`read_lease_fields` is its
    inverse."""
    return held_lease_fields(decision.lease_id, decision.leases, ticket)


def held_lease_fields(lease_id: str, keys: Sequence[str], ticket: str = "") -> list[tuple[str, str]]:
    """:func:`lease_fields` of leases ``keys`` held under ``lease_id`` (several decisions'
    under one id: the descriptors of one ShouldRateLimit)."""
    if not keys:
        return []
    fields = [(LEASE_ID_FIELD, lease_id), (LEASES_FIELD, _LEASE_SEP.join(keys))]
    if ticket:
        fields.append((LEASE_TICKET_FIELD, ticket))
    return fields


def read_lease_fields(lease_id: object, leases: object) -> tuple[list[str], str] | None:
    """(lease keys, lease id) from the two metadata values, or None when either is missing,
    not a string or empty."""
    if not isinstance(lease_id, str) or not isinstance(leases, str) or not lease_id:
        return None
    keys = [k for k in leases.split(_LEASE_SEP) if k]
    return (keys, lease_id) if keys else None


#: the largest count (``q``, ``r``, the body's ``limit``/``remaining``) and the longest time
#: in seconds (``Retry-After``, ``t``, ``w``) a header carries, whatever a limiter computed:
#: the policy's bounds keep them below (extauthz.policy.schema), these make sure. Seconds:
#: the longer of a bucket's longest refill and a quota's longest window (a 366-day year).
MAX_HEADER_COUNT = 10**9
MAX_HEADER_SECONDS = int(max(MAX_REFILL, 366 * 86400))


def _bounded(value: float, high: int) -> int:
    """``floor(value)`` within ``[0, high]``; NaN is 0 (never an OverflowError)."""
    if not value > 0:
        return 0
    return high if value >= high else math.floor(value)


def _seconds(value: float, low: int = 1) -> int:
    """Whole seconds, rounded up (a float just above a whole number is that number), at
    least ``low`` and at most :data:`MAX_HEADER_SECONDS`."""
    if not value < MAX_HEADER_SECONDS:  # also NaN
        return MAX_HEADER_SECONDS
    return max(low, math.ceil(value - 1e-9))


def _num(value: float) -> str:
    return str(_bounded(value, MAX_HEADER_COUNT))


def policy_item(v: Verdict) -> str | None:
    q = v.quota
    if q is None:
        return None
    item = f'"{v.limiter}";q={_num(q.limit)}'
    if q.window is not None:
        item += f";w={_seconds(q.window)}"
    if q.unit != "requests":
        item += f';qu="{q.unit}"'
    return item


def limit_item(v: Verdict) -> str | None:
    if v.quota is None or v.remaining is None:
        return None
    t = (_seconds(v.retry_after or 1.0) if v.outcome is Outcome.DENIED
         else _seconds(v.reset or 0.0, low=0))
    return f'"{v.limiter}";r={_num(v.remaining)};t={t}'


#: ``RateLimit-Policy`` values by the (limiter, quota) pairs they list: constant per policy.
_POLICY_HEADERS: dict[tuple[tuple[str, Quota | None], ...], str] = {}
_POLICY_HEADERS_MAX = 4096


def ratelimit_headers(decision: Decision) -> list[tuple[str, str]]:
    """``RateLimit-Policy`` and ``RateLimit`` for the per-user rate limiters that answered."""
    answered = [
        v for v in decision.verdicts
        if v.kind is Kind.RATE_LIMITER and (v.outcome is Outcome.ALLOWED or v.outcome is Outcome.DENIED)
        and v.quota is not None and v.remaining is not None
    ]
    if not answered:
        return []
    key = tuple([(v.limiter, v.quota) for v in answered])
    policy = _POLICY_HEADERS.get(key)
    if policy is None:
        policy = ", ".join([policy_item(v) or "" for v in answered])
        if len(_POLICY_HEADERS) < _POLICY_HEADERS_MAX:
            _POLICY_HEADERS[key] = policy
    return [("ratelimit-policy", policy), ("ratelimit", ", ".join([limit_item(v) or "" for v in answered]))]


@dataclass(frozen=True, slots=True)
class Denial:
    status: int
    headers: list[tuple[str, str]]
    body: str


def retry_after_seconds(v: Verdict) -> int:
    return _seconds(v.retry_after or 1.0)


def denial(ctx: RequestContext, decision: Decision) -> Denial:
    v = decision.denied_by
    assert v is not None, "denial() needs a refused decision"
    status = decision.http_status
    retry = retry_after_seconds(v)
    if v.outcome is Outcome.FAILED_CLOSED:
        reason = "store_unavailable"
        detail = (f"Limiter '{v.limiter}' could not reach its store and is configured to fail "
                  f"closed. Retry after {retry} s.")
    else:
        reason = v.reason or "denied"
        detail = v.detail or f"Refused by '{v.limiter}'. Retry after {retry} s."
    body: dict[str, object] = {
        "type": PROBLEM_TYPE + reason,
        "title": _TITLES.get(status, "Refused"),
        "status": status,
        "detail": detail,
        "limiter": v.limiter,
        "tier": ctx.tier.value,
        "retry_after": retry,
    }
    if v.limit is not None and v.kind is Kind.RATE_LIMITER:
        body["limit"] = _bounded(v.limit, MAX_HEADER_COUNT)  # whole requests, as in RateLimit-Policy
        body["remaining"] = _bounded(v.remaining or 0, MAX_HEADER_COUNT)
    if v.resets_at is not None:
        body["reset"] = datetime.fromtimestamp(v.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if ctx.request_id:
        body["request_id"] = ctx.request_id
    headers = [
        ("content-type", "application/problem+json"),
        ("retry-after", str(retry)),
        *ratelimit_headers(decision),
    ]
    return Denial(status, headers, json.dumps(body, separators=(",", ":")))
