"""Traffic files for ``extauthz simulate``: read, check, and put in time order.

Three line formats, told apart per line (all JSON objects, one request per line; files may
be gzip-compressed, recognised by their magic bytes):

* **recording** (``serve --record``): has ``identity`` (already hashed) and the server's
  ``tier``; the classifier is not run again, so the candidate policy sees the same users
  and tiers the server saw.
* **plain** JSON lines: ``time``, ``method``, ``path``, ``host``, ``headers``, ``duration``
  (seconds), ``tier``; the candidate policy's classifier reads the headers.
* **Envoy's JSON file access log** with the shipped ``json_format`` (envoy/access-log-json.yaml):
  the plain fields, with ``duration_ms`` (Envoy's ``%DURATION%``) instead of ``duration``
  and ``"-"``/``null`` for absent values.

``duration``: missing means 0 (released at once); ``null`` means the request's end never
became known (a recording whose access-log entry never came), so its leases are held until
their TTL, as they were on the server.

Bad lines (not JSON, no usable ``time``, ``method`` or ``path``, out of order by more than
the reorder window) raise :class:`TrafficError` naming the file and line, unless the
reader is told to skip them: then each one is counted by reason and the first few are
reported (nothing is dropped silently).

Order: Envoy and the recorder write a line when a request *finishes*, so start times are
out of order by up to a request's duration. Each file passes through a reorder buffer of
``window`` seconds; a line older than what was already replayed is a bad line.
"""

from __future__ import annotations

import gzip
import heapq
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

try:  # the tune extra: about 5x faster than the standard library on these lines
    from orjson import loads
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    from json import loads  # type: ignore[assignment]

_EMPTY: Mapping[str, str] = {}
_ABSENT = (None, "-", "")
_FLOAT = (float, int)


class TrafficError(ValueError):
    """A bad traffic line: ``file:line: message``."""


@dataclass(slots=True)
class Request:
    time: float
    method: str
    path: str
    host: str = ""
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    #: seconds; None: the end never became known (leases held until their TTL).
    duration: float | None = 0.0
    tier: str | None = None
    #: recordings only: the hashed identity and the rule that produced it.
    identity: str | None = None
    identity_source: str = "recorded"
    #: recordings only: what the server decided (``allowed`` or the refusing limiter's name).
    recorded: str | None = None
    #: recordings only: the plan the server gave the request (policy plans), if any.
    plan: str | None = None
    #: where the line came from (``file:line``), for messages.
    where: str = ""
    #: the client's address (``source_ip``), for identity rules and key parts that read it.
    source_ip: str = ""


@dataclass
class BadLines:
    """Skipped lines, counted by reason, with the first few places kept for the message."""

    skip: bool = False
    by_reason: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def bad(self, where: str, reason: str, message: str) -> None:
        if not self.skip:
            raise TrafficError(f"{where}: {message}")
        self.by_reason[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {message}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value in _ABSENT:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _text(value: Any) -> str | None:
    if value in _ABSENT:
        return None
    return value if isinstance(value, str) else str(value)


def parse_line(obj: Any, where: str) -> Request | str:
    """One decoded line -> :class:`Request`, or an error message."""
    if type(obj) is not dict:
        return "not a JSON object"
    get = obj.get
    raw_t = get("time")
    t = float(raw_t) if isinstance(raw_t, _FLOAT) and raw_t is not True and raw_t is not False else _number(raw_t)
    if t is None:
        return "missing 'time'" if raw_t in _ABSENT else f"bad 'time' {raw_t!r}"
    method = get("method")
    path = get("path")
    if type(method) is not str or method in _ABSENT or type(path) is not str or path in _ABSENT:
        method, path = _text(method), _text(path)
        if method is None or path is None:
            return f"missing '{'method' if method is None else 'path'}'"
    if "?" in path:
        path = path[: path.index("?")]
    if "duration" in obj:
        raw = obj["duration"]
        if type(raw) is float and raw >= 0:
            duration: float | None = raw
        else:
            duration = None if raw is None else _number(raw)
            if raw is not None and (duration is None or duration < 0):
                return f"bad 'duration' {raw!r}"
    elif "duration_ms" in obj:
        ms = _number(obj["duration_ms"])
        duration = None if ms is None else ms / 1000.0
    else:
        duration = 0.0
    headers: Mapping[str, str] = _EMPTY
    hdrs = get("headers")
    if hdrs:
        if type(hdrs) is not dict:
            return "'headers' is not an object"
        headers = {k.lower(): v for k, v in hdrs.items() if type(v) is str and v not in _ABSENT}
    elif hdrs not in (None, {}):
        return "'headers' is not an object"
    tier = get("tier")
    if tier is not None and (type(tier) is not str or tier in _ABSENT):
        tier = _text(tier)
    host = get("host")
    if type(host) is not str:
        host = _text(host) or ""
    source_ip = get("source_ip")
    if type(source_ip) is not str:
        source_ip = _text(source_ip) or ""
    identity = get("identity")
    if identity is None:
        return Request(t, method.upper(), path, host, headers, duration, tier, where=where, source_ip=source_ip)
    decision = get("decision")
    recorded = None
    if decision == "allowed":
        recorded = "allowed"
    elif decision == "refused":
        recorded = _text(get("limiter")) or "refused"
    return Request(t, method.upper(), path, host, headers, duration, tier, _text(identity),
                   _text(get("identity_source")) or "recorded", recorded, plan=_text(get("plan")), where=where,
                   source_ip=source_ip)


class TrafficFile:
    """Lines of one file (plain or gzip), with the byte position for a progress bar."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._raw: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed in lines()
        gz = self._raw.read(2) == b"\x1f\x8b"
        self._raw.seek(0)
        self._stream: IO[bytes] = (
            gzip.GzipFile(fileobj=self._raw) if gz else self._raw  # type: ignore[assignment]
        )

    @property
    def position(self) -> int:
        return self._raw.tell() if not self._raw.closed else self.size

    def lines(self, bad: BadLines) -> Iterator[Request]:
        name = str(self.path)
        try:
            for lineno, line in enumerate(self._stream, 1):
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                try:
                    obj = loads(line)
                except ValueError as exc:
                    bad.bad(where, "not_json", f"not JSON ({getattr(exc, 'msg', exc)})")
                    continue
                req = parse_line(obj, where)
                if isinstance(req, str):
                    bad.bad(where, "missing_field" if req.startswith("missing") else "bad_field", req)
                    continue
                yield req
        except (OSError, EOFError) as exc:  # a truncated gzip member (a file still being written)
            bad.bad(f"{name}:end", "truncated", f"cannot read further: {exc}")
        finally:
            self._stream.close()
            self._raw.close()


def in_order(requests: Iterator[Request], window: float, bad: BadLines) -> Iterator[Request]:
    """Requests in time order, given lines at most ``window`` seconds out of order."""
    heap: list[tuple[float, int, Request]] = []
    newest = -math.inf
    seq = 0
    for req in requests:
        if req.time < newest - window:
            bad.bad(req.where, "out_of_order",
                    f"time {req.time:.6f} is {newest - req.time:.3f} s before an earlier line's "
                    f"(lines may be out of order by at most --reorder-window {window:g} s)")
            continue
        seq += 1
        heapq.heappush(heap, (req.time, seq, req))
        if req.time > newest:
            newest = req.time
        while heap[0][0] < newest - window:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


def read_traffic(files: Sequence[TrafficFile], *, window: float = 120.0,
                 bad: BadLines | None = None) -> Iterator[Request]:
    """All files merged into one stream in time order."""
    bad = bad if bad is not None else BadLines()
    streams = [in_order(f.lines(bad), window, bad) for f in files]
    if len(streams) == 1:
        return streams[0]
    return heapq.merge(*streams, key=lambda r: r.time)
