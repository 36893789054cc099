"""Live overrides: one customer's numbers for one limiter, changed without a redeploy.

An override names a limiter and a **hashed** identity (the classifier's
:func:`~extauthz.policy.classify.hash_identity` with the fleet's salt: the raw value is hashed by
the ``extauthz override`` command and never stored, shown or sent) and sets that limiter
kind's numbers (``rate``/``burst``/``cost`` for ``request_rate``, ``limit`` for
``concurrent_requests``; numbers it does not set are the customer's plan's). It wins over
the plan, and it expires at its TTL.

Storage: every override lives in one JSON value at ``Keys.overrides``, and
``Keys.overrides_version`` changes with every change. The value's TTL is the latest expiry
plus a minute, so no override outlives its TTL; the version (a few bytes) expires the
longest override TTL plus a minute after the last change, and is never deleted by a change,
so a writer that lost a race cannot take it away while overrides exist. Each replica polls the
version key in the same one-second loop that reads the kill switches
(:class:`OverrideBoard.poll_once`, called by the server's fleet-state poll) and reads the
overrides only when it changed: with Redis every replica applies a change within about a
second; with the embedded store the admin port writes the same value and applies it at once.
A change is a compare-and-set of that value (a stored document like the kill switches,
:mod:`extauthz.control.documents`): two operators changing overrides in the same
instant both land; ``extauthz override list`` shows the result.

Bounds: at most :data:`MAX_OVERRIDES` live overrides (a new one beyond that is refused
with :class:`OverrideError`; changing or clearing an existing one still works) and a TTL
of at most :data:`MAX_TTL`. An override for a limiter the policy does not have (or whose
kind does not take those numbers, or hashed for an identity rule the policy does not have)
is kept, reported (``list``, ``/status``) and not applied; it applies again if a reload
brings the limiter (or the rule) back before it expires.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from ..core.errors import did_you_mean
from ..core.verdict import Limits
from ..limiters.base import Limiter
from ..policy.classify import valid_hash
from ..policy.schema import (
    PLAN_NUMBERS,
    ConcurrentRequestsPlan,
    RequestRatePlan,
    not_fields,
    parse_duration,
)
from ..store.base import Store, load_json
from ..store.keys import Keys
from .changelog import text_problem
from .documents import Board, Document

#: live overrides at most (the fleet's, all limiters); a new one beyond is refused.
MAX_OVERRIDES = 1000
#: the longest TTL an override may have, and the default.
MAX_TTL = 30 * 24 * 3600.0
DEFAULT_TTL = 24 * 3600.0
#: stored keys outlive the latest expiry by this much (clock skew between replicas).
KEY_SLACK = 60.0
_LIMITER = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_TEXT_MAX = 200


class OverrideError(ValueError):
    """A refused override change (bad numbers, too many, unknown limiter): the message
    says why."""


@dataclass(frozen=True, slots=True)
class Override:
    limiter: str
    #: the keyed hash of the identity (never the raw value).
    identity: str
    #: the identity rule label the hash was made for (``header:x-api-key``).
    source: str
    #: the numbers it sets: ``rate``/``burst``/``cost`` or ``limit``.
    numbers: Mapping[str, float]
    reason: str
    #: who set it ($USER or ``--by``) and when (Unix seconds).
    by: str
    set_at: float
    expires_at: float
    #: why the stored numbers are refused (read back from the store: written by hand or by an
    #: older version, e.g. ``burst: Infinity``): the entry is listed and never applied, and
    #: the next change of the overrides drops it. Empty for a valid override.
    refused: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["numbers"] = dict(self.numbers)
        if not self.refused:
            del out["refused"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Override:
        """An entry of the stored value. Its numbers are checked like a new override's: when
        they are refused the entry is kept with :attr:`refused` set (and only its finite
        numbers, so that it can still be shown as JSON). ValueError when the entry itself is
        malformed (fields missing, times not finite)."""
        numbers = data["numbers"]
        if not isinstance(numbers, dict):
            raise ValueError("numbers must be an object")
        set_at, expires_at = float(data["set_at"]), float(data["expires_at"])
        if not (math.isfinite(set_at) and math.isfinite(expires_at)):
            raise ValueError("set_at and expires_at must be finite")
        refused = ""
        try:
            checked = validate_numbers(numbers)
        except OverrideError as exc:
            refused = f"stored numbers refused: {exc}"
            checked = {str(k): float(v) for k, v in numbers.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        return cls(limiter=str(data["limiter"]), identity=str(data["identity"]),
                   source=str(data.get("source", "")), numbers=checked,
                   reason=str(data.get("reason", "")), by=str(data.get("by", "")),
                   set_at=set_at, expires_at=expires_at, refused=refused)


# -- validation (the policy's rules) ------------------------------------------------------


def _number(text: str) -> float | int | str:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text  # a rate like "100/s", or garbage the schema names


def parse_numbers(pairs: Sequence[str]) -> dict[str, Any]:
    """``["rate=1000", "burst=5000"]`` -> ``{"rate": 1000, "burst": 5000}`` (not yet validated)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise OverrideError(f"expected NAME=VALUE (rate=1000 burst=5000, or limit=200), got {pair!r}")
        if name in out:
            raise OverrideError(f"{name} is given twice")
        out[name] = _number(value.strip())
    return out


def validate_numbers(numbers: Mapping[str, Any], kind: str | None = None) -> dict[str, float]:
    """Check an override's numbers with the policy's own rules (a plan entry's: the same
    names, units, bounds and ``cost <= burst``): finite, within the policy's bounds
    (:mod:`extauthz.policy.schema`), integers where the policy takes integers. ``kind``: the
    limiter's type when known (the admin port, the CLI with ``--policies``): a name that kind
    does not take is refused as such; else the kind is guessed from the names. Returns them
    as plain numbers (``limit`` stays an integer)."""
    if not numbers:
        raise OverrideError("an override sets rate/burst/cost (request_rate) or limit "
                            "(concurrent_requests, quota)")
    if kind not in PLAN_NUMBERS:  # unknown, or a fleet-wide kind (compiling says so)
        kind = "concurrent_requests" if "limit" in numbers else "request_rate"
    else:
        unknown = sorted(set(numbers) - set(PLAN_NUMBERS[kind]))
        if unknown:
            raise OverrideError(not_fields(unknown, kind))
    model: type[RequestRatePlan] | type[ConcurrentRequestsPlan] = (
        ConcurrentRequestsPlan if kind in ("concurrent_requests", "quota") else RequestRatePlan)
    # a whole number written as 2.0 (JSON, an older CLI) is the integer 2
    given = {k: int(v) if k == "limit" and isinstance(v, float) and v.is_integer() and abs(v) < 2**63
             else v for k, v in numbers.items()}
    infinite = [k for k, v in given.items() if isinstance(v, float) and not math.isfinite(v)]
    if infinite:  # the schema's own words, for an integer field too
        raise OverrideError("; ".join(f"{k}: Input should be a finite number" for k in infinite))
    try:
        parsed = model.model_validate(given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = ("not a number of this limiter kind (request_rate: rate, burst, cost; "
                       "concurrent_requests, quota: limit)")
            problems.append(f"{where}: {msg}" if where else msg)
        raise OverrideError("; ".join(problems)) from None
    out: dict[str, float] = parsed.model_dump(exclude_none=True)
    return out


#: an override's TTL in days (``7d``; the policy's durations stop at hours)
_TTL_DAYS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*d\s*$")
TTL_USE = "a duration like 30m, 24h or 7d"


def parse_ttl(value: str | float) -> float:
    """An override's TTL: seconds, or ``500ms``, ``60s``, ``30m``, ``24h``, ``7d``; positive,
    at most :data:`MAX_TTL`."""
    text = str(value).strip()
    if text.startswith("-"):
        raise OverrideError(f"the TTL must be positive, not {text[:20]!r}: an override lasts {TTL_USE} "
                            "(extauthz override clear ends one now)")
    days = _TTL_DAYS.match(text) if isinstance(value, str) else None
    try:
        seconds = float(days.group(1)) * 86400.0 if days else float(parse_duration(value))
    except ValueError:
        raise OverrideError(f"bad TTL {text[:20]!r}: use seconds or {TTL_USE} (units ms, s, m, h, d)") from None
    if not math.isfinite(seconds):
        raise OverrideError(f"the TTL must be a finite number of seconds (got {value!r})")
    if seconds <= 0:
        raise OverrideError("the TTL must be positive")
    if seconds > MAX_TTL:
        raise OverrideError(f"the TTL is at most {MAX_TTL / 86400:g} days, {MAX_TTL / 3600:g}h "
                            f"(got {seconds / 86400:.4g} days, {seconds / 3600:.6g}h)")
    return seconds


def make_override(limiter: str, identity: str, numbers: Mapping[str, Any], *, ttl: str | float,
                  reason: str = "", by: str = "", source: str = "", now: float,
                  kind: str | None = None) -> Override:
    """A validated override (raises :class:`OverrideError`). ``kind``: the limiter's type
    when the caller knows the policy."""
    if not _LIMITER.match(limiter):
        raise OverrideError(f"bad limiter name {limiter!r}")
    if not valid_hash(identity):
        raise OverrideError("the identity must be a hashed identity (24 hex digits)")
    for text, what in ((reason, "the reason"), (by, "'by'"), (source, "the source")):
        problem = text_problem(text, what)
        if problem is not None:
            raise OverrideError(problem)
    return Override(limiter=limiter, identity=identity, source=source[:_TEXT_MAX],
                    numbers=validate_numbers(numbers, kind), reason=reason[:_TEXT_MAX], by=by[:_TEXT_MAX],
                    set_at=now, expires_at=now + parse_ttl(ttl))


# -- the stored value ---------------------------------------------------------------------


def parse_overrides(text: str | None) -> list[Override]:
    """The stored JSON (None: no overrides). Raises ValueError when malformed."""
    if not text:
        return []
    data = load_json(text)
    if not isinstance(data, dict) or not isinstance(data.get("overrides"), list):
        raise ValueError("overrides must be a JSON object {\"overrides\": [...]}")
    try:
        return [Override.from_dict(item) for item in data["overrides"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed override: {exc}") from None


def live(entries: Sequence[Override], now: float) -> list[Override]:
    return [e for e in entries if e.expires_at > now]


def with_override(entries: Sequence[Override], new: Override, now: float) -> list[Override]:
    """``entries`` (expired ones dropped) with ``new`` set; at the bound a new one is refused."""
    kept = [e for e in live(entries, now) if (e.limiter, e.identity) != (new.limiter, new.identity)]
    if len(kept) >= MAX_OVERRIDES:
        raise OverrideError(f"{len(kept)} overrides are live, the most the fleet keeps "
                            f"({MAX_OVERRIDES}): clear some (extauthz override clear) or wait "
                            "for them to expire")
    return sorted([*kept, new], key=lambda e: (e.limiter, e.identity))


def without_override(entries: Sequence[Override], limiter: str, identity: str,
                     now: float) -> tuple[list[Override], bool]:
    kept = live(entries, now)
    out = [e for e in kept if (e.limiter, e.identity) != (limiter, identity)]
    return out, len(out) != len(kept)


class OverrideDocument(Document[list[Override]]):
    """The stored overrides (:mod:`extauthz.control.documents`) with their version key. The value
    expires a minute after the latest override; the version outlives any override."""

    name = "overrides"
    version_ttl = MAX_TTL + KEY_SLACK

    def __init__(self, keys: Keys) -> None:
        super().__init__(keys.overrides, keys.overrides_version)

    def empty(self) -> list[Override]:
        return []

    def parse(self, text: str | None) -> list[Override]:
        return parse_overrides(text)

    def dump(self, doc: list[Override], now: float) -> tuple[str | None, float | None]:
        if not doc:
            return None, None
        ttl = max(e.expires_at for e in doc) - now + KEY_SLACK
        return json.dumps({"overrides": [e.to_dict() for e in doc]}, sort_keys=True), ttl

    def describe(self, doc: list[Override]) -> list[str]:
        return [f"{e.limiter}/{e.identity}" for e in doc][:50]

    def writable(self, doc: list[Override]) -> list[Override]:
        return [e for e in doc if not e.refused]  # refused: dropped at the next change

    def live(self, doc: list[Override], now: float) -> list[Override]:
        return live(doc, now)

    def expiry(self, doc: list[Override]) -> float:
        return min((e.expires_at for e in doc), default=math.inf)


# -- compiling against the limiters -------------------------------------------------------


#: identity hash -> limiter -> plan -> numbers (what the classifier reads).
Table = dict[str, dict[str, Mapping[str, Limits]]]


def source_problem(source: str, labels: Sequence[str]) -> str | None:
    """Why an identity hashed for rule ``source`` can never match under a policy whose
    identity rules are ``labels`` (the hash covers the rule's label), or None when it can
    (or the source is not recorded)."""
    if not source or source in labels:
        return None
    return (f"hashed for the identity rule {source}, which the policy does not have (its "
            f"identity rules: {', '.join(labels)}): set it again with --source {labels[0]}")


def compile_overrides(entries: Sequence[Override], limiters: Sequence[Limiter],
                      now: float, sources: Sequence[str] | None = None,
                      ) -> tuple[Table, dict[tuple[str, str], str]]:
    """The table of live overrides that fit the limiters, and why the others do not apply
    (``(limiter, identity) -> reason``). ``sources``: the policy's identity rule labels (an
    override hashed for another rule matches no request and is reported). Built at change,
    expiry and reload, never per request. Never raises: an entry that cannot be compiled
    (refused numbers, numbers that do not fit the limiter's plans, a bug) is left out and
    reported, so that one override never stops a snapshot from being built."""
    by_name = {lim.name: lim for lim in limiters}
    table: Table = {}
    not_applied: dict[tuple[str, str], str] = {}
    for e in live(entries, now):
        if e.refused:
            not_applied[(e.limiter, e.identity)] = e.refused
            continue
        lim = by_name.get(e.limiter)
        if lim is None:
            not_applied[(e.limiter, e.identity)] = (f"the policy has no limiter named '{e.limiter}'"
                                                    + did_you_mean(e.limiter, by_name))
            continue
        try:
            by_plan = lim.override(e.numbers)
        except Exception as exc:  # one override never fails the snapshot build
            # ValueError: the numbers do not fit this limiter's plans, or the limiter takes
            # none (a fleet-wide shedder: ``FleetWide.override``); anything else is a bug,
            # and still only this entry is left out (reported, and logged by the engine).
            not_applied[(e.limiter, e.identity)] = (
                str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
            continue
        why = source_problem(e.source, sources) if sources else None
        if why is not None:
            not_applied[(e.limiter, e.identity)] = why
            continue
        table.setdefault(e.identity, {})[e.limiter] = by_plan
    return table, not_applied


def refuse_unapplied(new: Override, limiters: Sequence[Limiter], labels: Sequence[str] | None) -> None:
    """Refuse (:class:`OverrideError`) an override that would not apply under a policy with
    these limiters and identity rule labels: the rule of the admin port and of the CLI with
    ``--policies``."""
    _, refused = compile_overrides([new], limiters, new.set_at, labels)
    if refused:
        raise OverrideError(next(iter(refused.values())))


def describe(entries: Sequence[Override], not_applied: Mapping[tuple[str, str], str] | None,
             now: float) -> list[dict[str, Any]]:
    """Rows for ``list`` and ``/status``: each live override, and whether it applies."""
    rows = []
    for e in live(entries, now):
        row = e.to_dict()
        row["expires_in"] = round(e.expires_at - now, 1)
        if not_applied is not None:
            why = not_applied.get((e.limiter, e.identity))
            row["applied"] = why is None
            if why is not None:
                row["not_applied"] = why
        rows.append(row)
    return rows


# -- the replica's side -------------------------------------------------------------------


class OverrideBoard(Board[list[Override]]):
    """Keeps the engine's overrides in step with the store (polled with the switches). An
    expiry that has passed re-applies (the engine drops the expired)."""

    def __init__(self, store: Store, keys: Keys, apply: Callable[[Sequence[Override]], None],
                 *, wall: Callable[[], float] = time.time) -> None:
        super().__init__(store, OverrideDocument(keys), apply, wall=wall)
