"""Runtime kill switches: stored in the store, polled by every replica.

The switches are one JSON object at ``Keys.switches`` (``{"*": "shadow", "user-rate":
"off"}``), read and written with ``Store.get_value``/``set_value``. With Redis every replica
sees a change at its next poll (about a second); with the embedded store the admin port
writes the same value in-process and applies it at once. ``*`` is the global switch. A
switch overrides the policy file's ``mode`` until it is cleared (precedence:
:meth:`Switches.effective`).

A change is a compare-and-set of that one value (:meth:`SwitchDocument.change
<extauthz.control.documents.Document.change>`, made through the one control path,
:class:`~extauthz.control.control.StoreControl`): two operators changing different switches in the
same instant both land (``extauthz switch --list`` shows the result).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.verdict import Mode
from ..store.base import Store, load_json
from .documents import Board, Document


@dataclass(frozen=True, slots=True)
class Switches:
    """Runtime kill switches. ``global_mode`` caps every limiter (``off`` < ``shadow`` <
    ``enforce``); a per-limiter switch replaces that limiter's policy ``mode``."""

    global_mode: Mode | None = None
    limiters: Mapping[str, Mode] = field(default_factory=dict)

    def effective(self, name: str, policy_mode: Mode) -> Mode:
        mode = self.limiters.get(name, policy_mode)
        if self.global_mode is Mode.OFF:
            return Mode.OFF
        if self.global_mode is Mode.SHADOW and mode is Mode.ENFORCE:
            return Mode.SHADOW
        return mode

    def to_dict(self) -> dict[str, str]:
        out = {name: mode.value for name, mode in sorted(self.limiters.items())}
        if self.global_mode is not None:
            out["*"] = self.global_mode.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> Switches:
        g = data.get("*")
        return cls(
            global_mode=Mode(g) if g else None,
            limiters={k: Mode(v) for k, v in data.items() if k != "*"},
        )


def limiter_modes(switches: Switches, specs: Iterable[Any]) -> dict[str, dict[str, str]]:
    """Each limiter of the policy (``specs``: its ``limiters``) with its type, its policy mode
    and its effective mode under ``switches`` (``/switches``, ``/status``, ``switch --list``)."""
    return {spec.name: {"type": spec.type, "policy_mode": spec.mode,
                        "mode": switches.effective(spec.name, Mode(spec.mode)).value} for spec in specs}


GLOBAL = "*"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def valid_name(name: str) -> bool:
    return name == GLOBAL or bool(_NAME.match(name))


def parse_switches(text: str | None) -> Switches:
    """The stored JSON (None or empty: no switches). Raises ValueError when malformed."""
    if not text:
        return Switches()
    data = load_json(text)
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in data.items()):
        raise ValueError("switches must be a JSON object of name -> 'enforce' | 'shadow' | 'off'")
    return Switches.from_dict(data)


def dump_switches(switches: Switches) -> str | None:
    data = switches.to_dict()
    return json.dumps(data, sort_keys=True) if data else None


class SwitchDocument(Document[Switches]):
    """The stored switches (:mod:`extauthz.control.documents`): their own version, no TTL (a switch
    holds until cleared)."""

    name = "switches"

    def empty(self) -> Switches:
        return Switches()

    def parse(self, text: str | None) -> Switches:
        return parse_switches(text)

    def dump(self, doc: Switches, now: float) -> tuple[str | None, float | None]:
        return dump_switches(doc), None

    def describe(self, doc: Switches) -> dict[str, str]:
        return doc.to_dict()


def with_switch(switches: Switches, name: str, mode: Mode | None) -> Switches:
    """``switches`` with ``name`` (or ``*``) set to ``mode``, or cleared when None."""
    data = switches.to_dict()
    if mode is None:
        data.pop(name, None)
    else:
        data[name] = mode.value
    return Switches.from_dict(data)


class SwitchBoard(Board[Switches]):
    """Reads and writes the stored switches and keeps the engine's in step."""

    def __init__(self, store: Store, key: str, apply: Callable[[Switches], None], *,
                 interval: float = 1.0) -> None:
        super().__init__(store, SwitchDocument(key), apply, interval=interval)
