"""A stored document: one JSON value in the store that operators change at run time and
every replica follows (the kill switches, :mod:`extauthz.control.switches`; the live overrides,
:mod:`extauthz.control.overrides`).

Written once here, for both:

* :class:`Document` says what the value is: its key, how it parses (a malformed value raises
  ValueError) and dumps (with the key's TTL), and optionally a **version key** that changes
  with every change, so that a replica reads the (larger) value only when it changed. Without
  a version key the value is its own version.
* :meth:`Document.change` is the one writer (through :class:`Held` documents, by the one
  control path :class:`~extauthz.control.control.StoreControl`: the admin port, the CLI on Redis): a
  compare-and-set through :func:`~extauthz.store.base.update_value`, so two operators changing
  the document in the same instant both land. A stored value that does not parse is replaced
  (the replicas already ignore it).
* :class:`Stored` is a document on the store, read and changed from outside a replica (the
  CLI on Redis); :class:`Board` is a replica's side: :meth:`Board.poll_once` reads the version
  and, when it moved, the value, and hands it to the engine (``apply``); a store error or a malformed value
  keeps the current document (logged once per streak / per version). :meth:`Board.update`
  changes the stored document and applies it here at once. :meth:`Board.status` reports the
  poll's errors and updates. Both are a :class:`Held` document (``read``, ``update``): the
  control path (:class:`~extauthz.control.control.StoreControl`) takes either.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ..core.errors import StoreError
from ..store.base import Store, update_value

T = TypeVar("T")


class Document(Generic[T]):
    """What one stored document is. Subclasses give :meth:`parse`, :meth:`dump` and
    :meth:`describe`; documents whose entries expire give :meth:`live` and :meth:`expiry`."""

    #: the name in log messages and events (``switches``: ``switches_changed``)
    name: str = "document"
    #: the version key's TTL (a version outlives anything the document holds)
    version_ttl: float | None = None

    def __init__(self, key: str, version_key: str | None = None) -> None:
        self.key = key
        self.version_key = version_key

    def empty(self) -> T:
        raise NotImplementedError

    def parse(self, text: str | None) -> T:
        """The stored text (None: the empty document). Raises ValueError when malformed."""
        raise NotImplementedError

    def dump(self, doc: T, now: float) -> tuple[str | None, float | None]:
        """The text to store (None: delete the key) and its TTL (None: none)."""
        raise NotImplementedError

    def describe(self, doc: T) -> Any:
        """What the logs show of ``doc`` (JSON-able)."""
        raise NotImplementedError

    def writable(self, doc: T) -> T:
        """What a change starts from, of a parsed stored document (e.g. entries the servers
        refuse are dropped)."""
        return doc

    def live(self, doc: T, now: float) -> T:
        """``doc`` without what expired by ``now``."""
        return doc

    def expiry(self, doc: T) -> float:
        """When the next part of ``doc`` expires (a replica re-applies then)."""
        return math.inf

    async def change(self, store: Store, edit: Callable[[T], T], now: float) -> tuple[T, str | None]:
        """Read, edit and write the stored document (a compare-and-set: ``edit`` is applied
        again on top of another writer's change), then move the version. Returns the new
        document and its version. Raises StoreError; whatever ``edit`` raises (a refusal)."""
        result = self.empty()

        def apply(stored: str | None) -> tuple[str | None, float | None]:
            nonlocal result
            try:
                current = self.writable(self.parse(stored))
            except ValueError:
                current = self.empty()  # overwrite a malformed value
            result = edit(current)
            return self.dump(result, now)

        written = await update_value(store, self.key, apply)
        if self.version_key is None:
            return result, written
        # A fresh version on every change, never deleted: a writer that lost the race above
        # (and wrote after the winner) cannot take the version away, so no replica misses it.
        version = f"{time.time_ns()}-{os.urandom(4).hex()}"
        await store.set_value(self.version_key, version, self.version_ttl)
        return result, version

    async def read(self, store: Store) -> T:
        """The stored document. Raises StoreError, ValueError (malformed)."""
        return self.parse(await store.get_value(self.key))


class Held(Protocol[T]):
    """A document as someone holding it reads and changes it."""

    async def read(self) -> T:
        """The document. Raises StoreError, ValueError (malformed)."""

    async def update(self, edit: Callable[[T], T]) -> T:
        """Change the stored document; the new one. Raises StoreError; whatever ``edit``
        raises (a refusal)."""


class Stored(Generic[T]):
    """A :class:`Held` document read and changed on the store itself (nothing applied here)."""

    def __init__(self, store: Store, document: Document[T], *, wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.document = document
        self.wall = wall

    async def read(self) -> T:
        return await self.document.read(self.store)

    async def update(self, edit: Callable[[T], T]) -> T:
        new, _ = await self.document.change(self.store, edit, self.wall())
        return new


class Board(Generic[T]):
    """A replica's copy of a stored document, kept in step with the store and applied to
    the engine (``apply``)."""

    def __init__(self, store: Store, document: Document[T], apply: Callable[[T], None], *,
                 wall: Callable[[], float] = time.time, interval: float = 1.0) -> None:
        self.store = store
        self.document = document
        self.apply = apply
        self.wall = wall
        self.interval = interval
        self.current: T = document.empty()
        #: the version read last (the stored text for a document without a version key)
        self.version: str | None = None
        self.errors = 0
        self.updates = 0
        self.log = logging.getLogger(f"extauthz.{document.name}")
        self._next_expiry = math.inf
        self._failing = False

    def status(self) -> dict[str, int]:
        return {"errors": self.errors, "updates": self.updates}

    def _set(self, doc: T, source: str, *, force: bool = False) -> None:
        doc = self.document.live(doc, self.wall())
        previous = self.current
        changed = doc != previous
        if not (changed or force):
            return
        self.current = doc
        self._next_expiry = self.document.expiry(doc)
        self.apply(doc)
        if changed:
            self.updates += 1
            name, now, was = self.document.name, self.document.describe(doc), self.document.describe(previous)
            self.log.warning("%s now %s (were %s)", name, now, was, extra={"fields": {
                "event": f"{name}_changed", name: now, "previous": was, "source": source}})

    async def poll_once(self) -> T:
        """Read the version; when it moved, read and apply the document; when a part of it
        expired, apply it again. On a store error or a malformed value the current document
        stays (logged once per streak / per version)."""
        doc, name = self.document, self.document.name
        try:
            if doc.version_key is None:
                version = text = await self.store.get_value(doc.key)
            else:
                version = await self.store.get_value(doc.version_key)
                text = await self.store.get_value(doc.key) if version != self.version else None
        except StoreError as exc:
            self.errors += 1
            if not self._failing:
                self.log.warning("cannot read %s (keeping %s): %s", name, doc.describe(self.current), exc,
                                 extra={"fields": {"event": f"{name}_read_failed", "error": str(exc)}})
            self._failing = True
            return self.current
        if self._failing:
            self.log.info("%s readable again", name, extra={"fields": {"event": f"{name}_read_ok"}})
            self._failing = False
        if version != self.version:
            self.version = version
            try:
                parsed = doc.parse(text)
            except ValueError as exc:
                self.errors += 1
                self.log.error("malformed %s at %s (keeping %s): %s", name, doc.key,
                               doc.describe(self.current), exc,
                               extra={"fields": {"event": f"{name}_malformed", "error": str(exc)}})
                return self.current
            self._set(parsed, "store", force=doc.version_key is not None)
        elif self.wall() >= self._next_expiry:
            self._set(self.current, "expiry", force=True)
        return self.current

    async def read(self) -> T:
        """What this replica applies (no store read: never raises)."""
        return self.current

    async def update(self, edit: Callable[[T], T]) -> T:
        """Change the stored document and apply it here at once (the admin port). Raises
        StoreError; whatever ``edit`` raises (a refusal)."""
        new, self.version = await self.document.change(self.store, edit, self.wall())
        self._set(new, "admin", force=True)
        return self.current
