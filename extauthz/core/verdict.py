"""Verdicts: what one limiter says, and the decision for the whole request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .tiers import Tier


class Mode(enum.StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"
    OFF = "off"


class Outcome(enum.StrEnum):
    """Stable metric label for one limiter's verdict on one request."""

    ALLOWED = "allowed"
    DENIED = "denied"
    SHADOW_DENIED = "shadow_denied"
    FAILED_OPEN = "failed_open"
    FAILED_CLOSED = "failed_closed"


class Kind(enum.StrEnum):
    """Rate limiters answer 429 (slow down), load shedders 503 (come back later)."""

    RATE_LIMITER = "rate_limiter"
    LOAD_SHEDDER = "load_shedder"


@dataclass(frozen=True, slots=True)
class Quota:
    """What a limiter promises, for the ``RateLimit-Policy`` header.

    ``unit`` is the IETF draft's quota unit: ``requests`` or ``concurrent-requests``.
    """

    limit: float
    window: float | None
    unit: str = "requests"


@dataclass(frozen=True, slots=True)
class Limits:
    """One limiter's numbers for one customer: the limiter's own, its plan's, or a live
    override's, resolved at load (policy) or at override change, never per request."""

    #: request_rate: tokens per second, bucket size, tokens per request.
    rate: float = 0.0
    burst: float = 0.0
    cost: float = 0.0
    #: concurrent_requests: requests in flight.
    limit: int = 0
    #: what the ``RateLimit-Policy`` header promises with these numbers.
    quota: Quota | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    limiter: str
    kind: Kind
    outcome: Outcome
    #: what the limiter allows (tokens in the bucket, slots, capacity); None if unbounded.
    limit: float | None = None
    #: headroom left after this request (tokens, free slots); None if unknown.
    remaining: float | None = None
    #: seconds until a refused request could pass; None when allowed or unknown.
    retry_after: float | None = None
    #: seconds until the limiter is back to full headroom (``RateLimit`` ``t``).
    reset: float | None = None
    #: a short reason label (``rate_exceeded``, ``concurrency_exceeded``, ...).
    reason: str = ""
    quota: Quota | None = None
    #: a sentence for people: what was exceeded and what to do (denials only).
    detail: str = ""
    #: quota: when its window ends (Unix seconds), named in the refusal's body.
    resets_at: float | None = None

    @property
    def refused(self) -> bool:
        """True when this verdict blocks the request (enforced denial or fail-closed)."""
        return self.outcome is Outcome.DENIED or self.outcome is Outcome.FAILED_CLOSED

    @property
    def would_deny(self) -> bool:
        return self.outcome is not Outcome.ALLOWED and self.outcome is not Outcome.FAILED_OPEN


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    tier: Tier
    verdicts: tuple[Verdict, ...] = ()
    #: the verdict that refused the request, if any.
    denied_by: Verdict | None = None
    #: leases held by an admitted request: (store key, lease id) pairs to release.
    leases: tuple[str, ...] = ()
    lease_id: str = ""
    #: fail-open reasons met while deciding (``timeout``, ``circuit_open``, ...).
    failures: tuple[str, ...] = field(default_factory=tuple)
    #: limiters that did not apply because a part of their key yielded nothing
    #: (``extauthz_limiter_skipped_total{limiter,reason="key_missing"}``).
    skipped: tuple[str, ...] = ()

    @property
    def http_status(self) -> int:
        if self.denied_by is None:
            return 200
        if self.denied_by.outcome is Outcome.FAILED_CLOSED:
            return 503
        return 429 if self.denied_by.kind is Kind.RATE_LIMITER else 503
