"""Structured logs: one JSON object per line.

:func:`configure_logging` is what ``extauthz serve`` uses: lines are formatted on the
caller's thread and written by a background thread (``QueueHandler``/``QueueListener``), so
a slow or blocked stderr never stalls the event loop.

:class:`DecisionLog` (an Observer) writes one ``decision`` record per denial, shadow
would-denial and fail-closed verdict, and a summary of store fail-opens once a second.
Records carry the classifier's identity hash, never the raw key or ``Authorization``
value. A flood of denials is capped (``max_per_second``); what the cap holds back is
counted in one ``decisions_suppressed`` record (the metrics count everything).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import sys
import time
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.verdict import Decision, Outcome, Verdict
from ..policy.model import Policy

DECISIONS_LOGGER = "extauthz.decisions"
ROUTE_MAX = 100
_LOGGED = (Outcome.DENIED, Outcome.SHADOW_DENIED, Outcome.FAILED_CLOSED)


def _iso(ts: float) -> str:
    t = time.gmtime(ts)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', t)}.{int(ts % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...fields, "exc"?}``; ``fields`` come from
    ``extra={"fields": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, separators=(",", ":"), default=str)


class _PreformattedQueueHandler(logging.handlers.QueueHandler):
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        line = self.format(record)
        record = logging.makeLogRecord({"msg": line, "levelno": record.levelno,
                                        "levelname": record.levelname, "name": record.name})
        return record


def configure_logging(level: str = "info", fmt: str = "json") -> logging.handlers.QueueListener:
    """Root logging for ``extauthz serve``: JSON (or ``text``) lines on stderr, written by
    a background thread. Stop the returned listener at exit to flush."""
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    handler = _PreformattedQueueHandler(q)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s"))
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(q, out)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    listener.start()
    return listener


def route_of(ctx: RequestContext) -> str:
    """``METHOD /path`` as given (query already stripped at the edge), at most 100 chars."""
    return f"{ctx.method} {ctx.path}"[:ROUTE_MAX]


class DecisionLog:
    def __init__(self, logger: logging.Logger | None = None, *, max_per_second: int = 1000,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.log = logger or logging.getLogger(DECISIONS_LOGGER)
        self.max_per_second = max_per_second
        self._clock = clock
        self._window = 0
        self._count = 0
        self.suppressed = 0  # since the last summary
        self.suppressed_total = 0
        self.written = 0
        self._failures: dict[str, int] = {}

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        for v in decision.verdicts:
            if v.outcome in _LOGGED:
                self._record(ctx, decision, v)
        for name in decision.skipped:
            self._skipped(ctx, decision, name)

    def _admit(self) -> bool:
        """Whether one more record fits this second's budget (else counted as suppressed)."""
        window = int(self._clock.monotonic())
        if window != self._window:
            self._window, self._count = window, 0
        if self._count >= self.max_per_second:
            self.suppressed += 1
            self.suppressed_total += 1
            return False
        self._count += 1
        self.written += 1
        return True

    def _skipped(self, ctx: RequestContext, decision: Decision, limiter: str) -> None:
        """A limiter that did not apply: a part of its key yielded nothing."""
        if not self._admit():
            return
        fields: dict[str, Any] = {
            "event": "decision", "outcome": "skipped", "limiter": limiter, "reason": "key_missing",
            "tier": ctx.tier.value, "identity": ctx.identity, "identity_source": ctx.identity_source,
            "route": route_of(ctx), "request_id": ctx.request_id, "status": decision.http_status,
        }
        self.log.info("skipped by %s (key_missing)", limiter, extra={"fields": fields})

    def _record(self, ctx: RequestContext, decision: Decision, v: Verdict) -> None:
        if not self._admit():
            return
        fields: dict[str, Any] = {
            "event": "decision",
            "outcome": v.outcome.value,
            "limiter": v.limiter,
            "kind": v.kind.value,
            "reason": v.reason,
            "tier": ctx.tier.value,
            "tier_source": ctx.tier_source,
            "identity": ctx.identity,
            "identity_source": ctx.identity_source,
            "plan": ctx.plan,
            "plan_source": ctx.plan_source,
            "route": route_of(ctx),
            "remaining": v.remaining,
            "limit": v.limit,
            "retry_after": v.retry_after,
            "request_id": ctx.request_id,
            "status": decision.http_status,
        }
        self.log.info("%s by %s", v.outcome.value, v.limiter, extra={"fields": fields})

    def store_failed(self, reason: str) -> None:
        self._failures[reason] = self._failures.get(reason, 0) + 1

    def flush(self) -> None:
        """Once a second (the server's housekeeping): summaries of what was not logged."""
        if self._failures:
            failures, self._failures = self._failures, {}
            self.log.warning("store failures while deciding: %s", ", ".join(
                f"{n}x {r}" for r, n in sorted(failures.items())),
                extra={"fields": {"event": "store_failures", "reasons": failures}})
        if self.suppressed:
            n, self.suppressed = self.suppressed, 0
            self.log.warning("%d decision records suppressed (more than %d/s)", n, self.max_per_second,
                             extra={"fields": {"event": "decisions_suppressed", "count": n}})
