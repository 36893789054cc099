"""Runtime kill switches: stored in the store, polled by every replica.

The switches are one JSON object at ``Keys.switches`` (``{"*": "shadow", "user-rate":
"off"}``), read and written with ``Store.get_value``/``set_value``. With Redis every replica
sees a change at its next poll (about a second); with the embedded store the admin port
writes the same value in-process and applies it at once. ``*`` is the global switch. A
switch overrides the policy file's ``mode`` until it is cleared (precedence:
:meth:`Switches.effective`).

A change is a compare-and-set of that one value (:func:`change_stored`, through
:func:`~extauthz.store.base.update_value`): two operators changing different switches in the
same instant both land (``extauthz switch --list`` shows the result).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .errors import StoreError
from .store.base import Store, load_json, update_value
from .verdict import Mode

log = logging.getLogger("extauthz.switches")


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


async def change_stored(store: Store, key: str, name: str, mode: Mode | None) -> Switches:
    """Set (or with None clear) one switch in the store: the one writer (admin port and
    CLI), a compare-and-set (:func:`~extauthz.store.base.update_value`) so two operators
    flipping switches at once both land. A malformed stored value is overwritten. The key
    has no TTL: a switch holds until cleared. Raises StoreError, ValueError (bad name)."""
    if not valid_name(name):
        raise ValueError(f"bad switch name {name!r}")
    new = Switches()

    def apply(stored: str | None) -> tuple[str | None, float | None]:
        nonlocal new
        try:
            current = parse_switches(stored)
        except ValueError:
            current = Switches()  # overwrite a malformed value
        new = with_switch(current, name, mode)
        return dump_switches(new), None

    await update_value(store, key, apply)
    return new


def with_switch(switches: Switches, name: str, mode: Mode | None) -> Switches:
    """``switches`` with ``name`` (or ``*``) set to ``mode``, or cleared when None."""
    data = switches.to_dict()
    if mode is None:
        data.pop(name, None)
    else:
        data[name] = mode.value
    return Switches.from_dict(data)


class SwitchBoard:
    """Reads and writes the stored switches and keeps the engine's in step."""

    def __init__(self, store: Store, key: str, apply: Callable[[Switches], None], *,
                 interval: float = 1.0) -> None:
        self.store = store
        self.key = key
        self.apply = apply
        self.interval = interval
        self.current = Switches()
        self.errors = 0
        self.updates = 0
        self._failing: str | None = None
        self._bad_value: str | None = None

    def _set(self, switches: Switches, source: str) -> None:
        if switches == self.current:
            return
        previous = self.current
        self.apply(switches)
        self.current = switches
        self.updates += 1
        log.warning("kill switches now %s (were %s)", switches.to_dict() or "{}", previous.to_dict() or "{}",
                    extra={"fields": {"event": "switches_changed", "switches": switches.to_dict(),
                                      "previous": previous.to_dict(), "source": source}})

    async def poll_once(self) -> Switches:
        """Read the stored switches and apply them. On a store error or a malformed value
        the current switches stay (logged once per streak / per value)."""
        try:
            text = await self.store.get_value(self.key)
        except StoreError as exc:
            self.errors += 1
            if self._failing is None:
                log.warning("cannot read kill switches (keeping %s): %s", self.current.to_dict(), exc,
                            extra={"fields": {"event": "switches_read_failed", "error": str(exc)}})
            self._failing = str(exc)
            return self.current
        if self._failing is not None:
            log.info("kill switches readable again", extra={"fields": {"event": "switches_read_ok"}})
            self._failing = None
        try:
            switches = parse_switches(text)
        except ValueError as exc:
            if text != self._bad_value:
                self.errors += 1
                log.error("malformed kill switches at %s (keeping %s): %s", self.key,
                          self.current.to_dict(), exc,
                          extra={"fields": {"event": "switches_malformed", "error": str(exc)}})
                self._bad_value = text
            return self.current
        self._bad_value = None
        self._set(switches, "store")
        return switches

    async def change(self, name: str, mode: Mode | None) -> Switches:
        """Set (or with None clear) one switch in the store and apply it here at once.
        Raises StoreError when the store cannot be read or written."""
        new = await change_stored(self.store, self.key, name, mode)
        self._set(new, "admin")
        return new
