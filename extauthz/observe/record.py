"""``serve --record DIR``: one JSON line per finished request, for ``extauthz simulate``.

Two hooks feed it, both cheap and on the event loop:

* :meth:`Recorder.decided` (an engine observer) builds the line at the decision: start time
  (wall clock), hashed identity (never the raw value), plan (when the policy has plans), tier,
  method, path (the edge already cut the query), host, the decision (``allowed`` or
  ``refused`` with the refusing ``limiter``, plus ``would_refuse``: shadow limiters that
  would have refused) and the HTTP status. The line waits for its request's end, keyed by
  ``x-request-id``.
* :meth:`Recorder.finished` (the access-log path) adds the ``duration`` and queues it.
  Requests whose entry never came are queued with ``"duration": null`` after
  ``pending_ttl`` (the longest lease TTL): the replay then holds their leases for the TTL,
  as the server did.

:meth:`Recorder.flush` (the server's background runner calls it every ``flush_interval``)
hands the queue to a worker thread: JSON encoding, gzip and the file write never run on the event loop's
turn. Files (``record-<UTC time>-<pid>-<n>.jsonl.gz``, gzip members appended per flush, so
a file is readable while it grows) rotate before a write would take the current file past
``file_bytes``, and before each write the oldest are deleted until the files, the current one
included, plus the write fit ``max_bytes``: the directory never holds more. A flush larger
than a file is written in pieces. With ``--workers N`` each worker has its own directory
(``DIR/worker-<i>``, ``max_bytes / N`` each), so no worker deletes another's files.

Paths are recorded redacted by default (:func:`redact_path`): path parameters (``;...``)
are dropped and id-like segments (numbers, tokens with digits, ``prefix_XXXX`` keys, long
or email-like segments) become ``{id}``. A recording leaves the server (it is copied to
where ``extauthz simulate`` runs) and limits match path prefixes, not ids.

``sample`` < 1 keeps a fraction of *identities* (by their hash), every request of each,
so per-user limits replay as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.verdict import Decision, Outcome
from ..policy.model import Policy
from .base import ObserverBase

log = logging.getLogger("extauthz.record")

Line = dict[str, Any]

#: what an id-like path segment becomes in a recording
ID_PLACEHOLDER = "{id}"
_ID_SEGMENT = re.compile(r"""
    \d+                                      # a number
  | (?=[^/]*\d)[^/]{8,}                      # 8 characters or more with a digit: ids, UUIDs, dates
  | [^/]{24,}                                # a long token
  | [^/]*@[^/]*                              # an email address
  | [A-Za-z]+(?:_[A-Za-z]+)*_(?=[^/_]*[A-Z0-9])[^/_]{4,}   # prefixed ids and keys: sk_live_XXXX
""", re.VERBOSE)


def redact_path(path: str) -> str:
    """``path`` without path parameters (``;...`` of every segment) and with id-like segments
    replaced by ``{id}``: ``/v1/keys/sk_live_SECRET;session=1`` -> ``/v1/keys/{id}``."""
    out = []
    for segment in path.split("/"):
        segment = segment.split(";", 1)[0]
        out.append(ID_PLACEHOLDER if _ID_SEGMENT.fullmatch(segment) else segment)
    return "/".join(out)


class RotatingWriter:
    """Appends gzip members to ``record-*.jsonl.gz`` files; rotates and bounds the total."""

    def __init__(self, directory: str | Path, max_bytes: int, file_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.file_bytes = min(max_bytes, file_bytes or max(4096, min(64 << 20, max_bytes // 8)))
        self.current: Path | None = None
        self._n = 0
        self.bytes_written = 0
        self.files_deleted = 0
        #: lines larger than a whole file, compressed (not written)
        self.lines_dropped = 0

    def _next_file(self) -> Path:
        self._n += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return self.directory / f"record-{stamp}-{os.getpid()}-{self._n:05d}.jsonl.gz"

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("record-*.jsonl.gz"), key=lambda p: (p.stat().st_mtime, p.name))

    def write(self, lines: Sequence[Line]) -> None:
        for data in self._members(lines):
            self._append(data)

    def _members(self, lines: Sequence[Line]) -> Iterator[bytes]:
        """Gzip members of at most ``file_bytes`` each (a batch too big is split in halves)."""
        if not lines:
            return
        data = gzip.compress("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode(),
                             compresslevel=6)
        if len(data) <= self.file_bytes:
            yield data
        elif len(lines) == 1:
            self.lines_dropped += 1
            log.warning("recording: a line of %d bytes compressed is larger than a file (%d); "
                        "not written", len(data), self.file_bytes)
        else:
            half = len(lines) // 2
            yield from self._members(lines[:half])
            yield from self._members(lines[half:])

    def _append(self, data: bytes) -> None:
        current = self.current
        size = current.stat().st_size if current is not None and current.exists() else None
        if current is None or size is None or size + len(data) > self.file_bytes:
            current = self.current = self._next_file()
        self._make_room(len(data))
        with open(current, "ab") as f:
            f.write(data)
        self.bytes_written += len(data)

    def _make_room(self, incoming: int) -> None:
        """Delete the oldest files until all of them (the current one counts) plus
        ``incoming`` bytes fit ``max_bytes``."""
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        for old in files:
            if total + incoming <= self.max_bytes:
                break
            if old == self.current:
                continue
            total -= old.stat().st_size
            old.unlink(missing_ok=True)
            self.files_deleted += 1


class Recorder(ObserverBase):
    def __init__(self, directory: str | Path, *, max_bytes: int = 1 << 30, sample: float = 1.0,
                 pending_ttl: float = 60.0, flush_interval: float = 1.0, clock: Clock = SYSTEM_CLOCK,
                 max_pending: int = 200_000, file_bytes: int | None = None,
                 redact_paths: bool = True) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"--record-sample must be in (0, 1], not {sample}")
        if max_bytes <= 0:
            raise ValueError(f"--record-max-bytes must be positive, not {max_bytes}")
        self.writer = RotatingWriter(directory, max_bytes, file_bytes)
        self.sample = sample
        self.redact_paths = redact_paths
        self._threshold = int(sample * 0xFFFFFFFF)
        self.pending_ttl = pending_ttl
        self.flush_interval = flush_interval
        self.clock = clock
        self.max_pending = max_pending
        #: request id -> (line, queue without duration at this wall time), oldest first
        self._pending: dict[str, tuple[Line, float]] = {}
        self._queue: list[Line] = []
        self.recorded = 0
        self.unsampled = 0
        self.without_duration = 0
        self.write_errors = 0

    # -- hooks (event loop) -------------------------------------------------------------
    def sampled(self, identity: str) -> bool:
        if self._threshold >= 0xFFFFFFFF:
            return True
        try:
            return int(identity[:8], 16) <= self._threshold
        except ValueError:
            return True

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        if ctx.descriptor_target is not None:  # a rate limit descriptor: simulate replays checks only
            return
        if not self.sampled(ctx.identity):
            self.unsampled += 1
            return
        denied = decision.denied_by
        now = self.clock.wall()
        line: Line = {
            "time": round(now, 6), "identity": ctx.identity, "identity_source": ctx.identity_source,
            "plan": ctx.plan or None, "tier": ctx.tier.value, "method": ctx.method,
            "path": redact_path(ctx.path) if self.redact_paths else ctx.path, "host": ctx.host,
            "decision": "allowed" if decision.allowed else "refused",
            "limiter": denied.limiter if denied is not None else None,
            "would_refuse": [v.limiter for v in decision.verdicts if v.outcome is Outcome.SHADOW_DENIED],
            "status": decision.http_status, "duration": None,
        }
        rid = ctx.request_id
        if not rid:
            self._queue_line(line, None)
            return
        old = self._pending.pop(rid, None)
        if old is not None:  # a client-chosen request id used twice: the first one's end is unknown
            self._queue_line(old[0], None)
        self._pending[rid] = (line, now + self.pending_ttl)
        if len(self._pending) > self.max_pending:
            first = next(iter(self._pending))
            self._queue_line(self._pending.pop(first)[0], None)

    def finished(self, request_id: str, duration: float | None) -> None:
        """The access log reported the request finished (``duration`` in seconds, or None
        when the entry does not say: then the time since its start)."""
        item = self._pending.pop(request_id, None)
        if item is None:
            return
        line = item[0]
        if duration is None:
            duration = max(0.0, self.clock.wall() - line["time"])
        self._queue_line(line, round(duration, 6))

    def _queue_line(self, line: Line, duration: float | None) -> None:
        line["duration"] = duration
        if duration is None:
            self.without_duration += 1
        self.recorded += 1
        self._queue.append(line)

    # -- background ---------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock.wall()
        pending = self._pending
        while pending:
            rid = next(iter(pending))
            line, until = pending[rid]
            if until > now:
                break
            del pending[rid]
            self._queue_line(line, None)

    def take(self) -> list[Line]:
        """Expire what waited too long and take the queued lines."""
        self._expire()
        lines, self._queue = self._queue, []
        return lines

    def _write(self, lines: list[Line]) -> None:
        try:
            self.writer.write(lines)
        except OSError as exc:
            self.write_errors += 1
            log.warning("recording: could not write %d lines: %s", len(lines), exc)

    async def flush(self) -> None:
        lines = self.take()
        if lines:
            await asyncio.to_thread(self._write, lines)

    async def close(self) -> None:
        """Write everything, the requests still waiting for their end included (no duration)."""
        for line, _ in self._pending.values():
            self._queue_line(line, None)
        self._pending.clear()
        with contextlib.suppress(Exception):
            await self.flush()

    def status(self) -> dict[str, Any]:
        return {"directory": str(self.writer.directory), "recorded": self.recorded,
                "pending": len(self._pending), "unsampled": self.unsampled,
                "without_duration": self.without_duration, "bytes_written": self.writer.bytes_written,
                "files_deleted": self.writer.files_deleted, "lines_dropped": self.writer.lines_dropped,
                "write_errors": self.write_errors}


def pending_ttl(policy: Policy) -> float:
    """The longest lease TTL of the policy: how long a request's end is waited for."""
    return max(60.0, policy.longest_lease_ttl)
