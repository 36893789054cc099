"""Who changed a kill switch or an override, when and why: the change log.

Every change (through the admin port or ``extauthz switch|override --redis-url``) becomes one
:class:`Change`: kind (``switch`` or ``override``), action (``set`` or ``clear``), target (a
limiter name or ``*``; for an override ``LIMITER IDENTITY``, the identity hashed), the new
value, the reason, who (``by``: the name of the admin token that authenticated it, from a
``NAME:TOKEN`` line of ``--admin-token-file``; ``user``: the OS user the client names, which
the server cannot check), when, and which host took it (``server``, ``via`` admin or redis).

A change is written three ways: a log line (``event: admin_change``), the server's
``/status`` (``changes``: the last :data:`RECENT` made through that server), and the store's
bounded event log at ``Keys.history`` (``Store.append_events``: on Redis one stream the whole
fleet shares, at most about :data:`HISTORY_MAXLEN` entries, expiring :data:`HISTORY_TTL`
after the last change). ``extauthz history`` prints that log.

The text people give (the reason, the user, an override's ``by``) holds no control character
(:func:`text_problem`: refused where it enters, 400 on the admin port, an error in the
commands), and what is printed for people goes through :func:`printable`, so that a record
an older version stored, or one written straight into Redis, cannot move the cursor, recolour
the terminal or forge a line.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import StoreError
from ..store.base import Store, load_json

log = logging.getLogger("extauthz.changes")

#: changes kept in a server's /status.
RECENT = 100
#: entries kept in the store's log (about: Redis trims approximately), and its TTL.
HISTORY_MAXLEN = 1000
HISTORY_TTL = 90 * 24 * 3600.0
KINDS = ("switch", "override")
ACTIONS = ("set", "clear")
#: the action of an override's lapse: never stored, derived from its set (:func:`with_expiries`)
EXPIRE = "expire"
#: what no reason or name may hold and what is escaped when printed: the C0 and C1 controls
#: and DEL (escape sequences, CR and LF: a forged line), the line and paragraph separators
#: and the bidirectional formatting characters (text displayed in another order).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def text_problem(text: str, what: str) -> str | None:
    """Why ``text`` (a reason, a user name) is refused, or None: it holds a control character."""
    found = _CONTROL.search(text)
    if found is None:
        return None
    return (f"{what} holds a control character ({_escape(found)} at position {found.start() + 1}): "
            "give it as plain text on one line")


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\x1b``, ``\\n``, ``\\u202e``)."""
    return _CONTROL.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    return repr(found.group())[1:-1]  # none of them is printable: repr escapes each


@dataclass(frozen=True, slots=True)
class Change:
    kind: str
    action: str
    target: str
    value: Any = None
    reason: str = ""
    by: str | None = None
    user: str = ""
    at: float = 0.0
    server: str = field(default_factory=socket.gethostname)
    via: str = "admin"
    #: an override set: when it lapses (its TTL); ``history`` shows the lapse (:func:`with_expiries`)
    expires_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Change:
        kind, action = str(data["kind"]), str(data["action"])
        if kind not in KINDS or action not in ACTIONS:
            raise ValueError(f"unknown change {kind}/{action}")
        at = float(data.get("at", 0.0))
        by = data.get("by")
        expires = data.get("expires_at")
        expires_at = float(expires) if isinstance(expires, (int, float)) and math.isfinite(expires) else None
        return cls(kind=kind, action=action, target=str(data["target"]), value=data.get("value"),
                   reason=str(data.get("reason", "")), by=None if by is None else str(by),
                   user=str(data.get("user", "")), at=at if math.isfinite(at) else 0.0,
                   server=str(data.get("server", "")), via=str(data.get("via", "")), expires_at=expires_at)

    @property
    def who(self) -> str:
        if self.by and self.user:
            return f"{self.by} ({self.user})"
        return self.by or self.user or "-"

    def describe(self) -> str:
        what = ({"clear": "cleared", EXPIRE: "expired (its TTL ran out)"}.get(self.action)
                or f"set to {_value(self.value)}")
        return f"{self.kind} {self.target} {what}"


def format_number(v: float) -> str:
    """5000000, not 5e+06: whole numbers whole, others to six significant digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={format_number(v)}" if isinstance(v, (int, float)) else f"{k}={v}"
                        for k, v in sorted(value.items()))
    return "-" if value is None else str(value)


def parse_history(events: Iterable[str]) -> list[Change]:
    """The stored events, oldest first; a malformed one is skipped."""
    out: list[Change] = []
    for raw in events:
        try:
            data = load_json(raw)  # a ValueError for anything malformed, nesting too
            if isinstance(data, dict):
                out.append(Change.from_dict(data))
        except (ValueError, TypeError, KeyError):
            continue
    return out


async def append_change(store: Store, key: str, change: Change) -> None:
    """Add one change to the fleet's log. Raises StoreError."""
    await store.append_events(key, [json.dumps(change.to_dict(), sort_keys=True)],
                              HISTORY_MAXLEN, HISTORY_TTL)


async def read_history(store: Store, key: str, since: float = 0.0) -> list[Change]:
    return parse_history(await store.read_events(key, since))


class ChangeLog:
    """Where every change is recorded, whoever made it (the one writer:
    :class:`~extauthz.control.control.StoreControl`): keep the last :data:`RECENT` (a server's
    ``/status``), log it (``log_changes``: a server's logs; a command run by hand prints its own
    result instead) and append it to the store's log. A store that does not take the record
    is counted and logged (without ``log_changes``: kept in :attr:`failed` for the command to
    say): the change itself has landed."""

    def __init__(self, store: Store, key: str, *, wall: Any = time.time, log_changes: bool = True) -> None:
        self.store = store
        self.key = key
        self.wall = wall
        self.log_changes = log_changes
        self.recent: deque[Change] = deque(maxlen=RECENT)
        #: changes that could not be added to the store's log (the change itself landed)
        self.errors = 0
        #: the last record the store did not take, and why (what a command says on stderr)
        self.failed: str | None = None

    async def record(self, change: Change) -> Change:
        change = Change(**{**change.to_dict(), "at": change.at or self.wall()})
        self.recent.append(change)
        if self.log_changes:
            log.warning("%s by %s: %s", change.describe(), change.who, change.reason or "(no reason)",
                        extra={"fields": {"event": "admin_change", **change.to_dict()}})
        try:
            await append_change(self.store, self.key, change)
        except StoreError as exc:
            self.errors += 1
            self.failed = f"{change.describe()}: {exc}"
            if self.log_changes:
                log.error("the change log in the store did not take %s: %s", change.describe(), exc,
                          extra={"fields": {"event": "change_log_failed", "error": str(exc)}})
        return change

    async def read(self) -> list[Change]:
        """The store's log, oldest first. Raises StoreError."""
        return await read_history(self.store, self.key)

    def status(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.recent]


def with_expiries(changes: list[Change], now: float) -> list[Change]:
    """``changes`` with a row for each override that lapsed: one set with an expiry
    (``expires_at``) that passed before ``now`` and before any later change of the same
    override (a set again, a clear). Derived, not recorded: no server has to be up when a TTL
    runs out, and every reader of the log agrees. (Sets recorded before the expiry was kept
    have none, and show no lapse.)"""
    lapses: list[Change] = []
    for i, c in enumerate(changes):
        if c.kind != "override" or c.action != "set" or c.expires_at is None or c.expires_at > now:
            continue
        if any(later.target == c.target and later.kind == "override" and later.at <= c.expires_at
               for later in changes[i + 1:]):
            continue  # replaced or cleared before it lapsed
        lapses.append(Change(kind="override", action=EXPIRE, target=c.target, value=None,
                             reason="TTL ran out", by=None, user="", at=c.expires_at, server="", via="ttl"))
    lapses.sort(key=lambda c: c.at)
    out: list[Change] = []
    for c in changes:  # the log's own order kept; each lapse before the first change after it
        while lapses and lapses[0].at < c.at:
            out.append(lapses.pop(0))
        out.append(c)
    return out + lapses


def format_history(changes: list[Change]) -> str:
    if not changes:
        return "no changes recorded"
    out = [f"{'when (UTC)':<20} {'kind':<8} {'action':<6} {'target':<40} {'value':<24} "
           f"{'who':<24} {'server':<20} reason"]
    for c in changes:  # any field may have been written straight into the store
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.at))
        out.append(printable(f"{when:<20} {c.kind:<8} {c.action:<6} {c.target:<40} {_value(c.value):<24} "
                             f"{c.who:<24} {c.server + ' (' + c.via + ')':<20} {c.reason}"))
    return "\n".join(out)
