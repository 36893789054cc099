"""The stored-document pattern (extauthz/control/documents.py): one JSON value operators change, a
compare-and-set writer and a replica's board, on the embedded store with an injected clock."""

from __future__ import annotations

import json
import math

from extauthz.control.documents import Board, Document
from extauthz.core.clock import ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.store.memory import MemoryStore


class Names(Document[dict[str, float]]):
    """A toy document: name -> expiry (Unix seconds)."""

    name = "names"

    def empty(self) -> dict[str, float]:
        return {}

    def parse(self, text: str | None) -> dict[str, float]:
        if not text:
            return {}
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("names must be an object")
        return {str(k): float(v) for k, v in data.items()}

    def dump(self, doc: dict[str, float], now: float) -> tuple[str | None, float | None]:
        return (json.dumps(doc, sort_keys=True) if doc else None), None

    def describe(self, doc: dict[str, float]) -> list[str]:
        return sorted(doc)

    def live(self, doc: dict[str, float], now: float) -> dict[str, float]:
        return {k: v for k, v in doc.items() if v > now}

    def expiry(self, doc: dict[str, float]) -> float:
        return min(doc.values(), default=math.inf)


class Failing(MemoryStore):
    """The embedded store whose reads fail while ``down`` (a store outage)."""

    down = False

    async def get_value(self, key: str) -> str | None:
        if self.down:
            raise StoreUnavailable("down")
        return await super().get_value(key)


async def test_a_board_without_a_version_key_applies_each_new_value_once() -> None:
    store = MemoryStore()
    applied: list[dict[str, float]] = []
    board = Board(store, Names("k"), applied.append)
    await board.poll_once()
    assert applied == []  # nothing stored: nothing to apply
    await store.set_value("k", '{"a": 1e12}')
    await board.poll_once()
    await board.poll_once()
    assert applied == [{"a": 1e12}] and board.status() == {"errors": 0, "updates": 1}


async def test_a_malformed_value_keeps_the_current_document_and_counts_once() -> None:
    store = MemoryStore()
    applied: list[dict[str, float]] = []
    board = Board(store, Names("k"), applied.append)
    await store.set_value("k", '{"a": 1e12}')
    await board.poll_once()
    await store.set_value("k", "[1]")
    assert await board.poll_once() == {"a": 1e12}
    assert await board.poll_once() == {"a": 1e12}
    assert board.errors == 1 and len(applied) == 1


async def test_a_store_outage_keeps_the_current_document() -> None:
    store = Failing()
    board = Board(store, Names("k"), lambda doc: None)
    await store.set_value("k", '{"a": 1e12}')
    await board.poll_once()
    store.down = True
    assert await board.poll_once() == {"a": 1e12}
    assert await board.poll_once() == {"a": 1e12}
    assert board.errors == 2
    store.down = False
    await store.set_value("k", '{"b": 1e12}')
    assert await board.poll_once() == {"b": 1e12}


async def test_with_a_version_key_the_value_is_read_only_when_the_version_moves() -> None:
    store = MemoryStore()
    doc = Names("k", "k:version")
    board = Board(store, doc, lambda d: None)
    new, version = await doc.change(store, lambda d: {**d, "a": 1e12}, 0.0)
    assert new == {"a": 1e12} and version == await store.get_value("k:version")
    await board.poll_once()
    assert board.current == {"a": 1e12}
    await store.set_value("k", '{"sneaked": 1e12}')  # written without moving the version
    await board.poll_once()
    assert board.current == {"a": 1e12}
    await doc.change(store, lambda d: {**d, "b": 1e12}, 0.0)  # on top of what is stored
    await board.poll_once()
    assert board.current == {"b": 1e12, "sneaked": 1e12}


async def test_a_change_overwrites_a_malformed_value_and_applies_here_at_once() -> None:
    store = MemoryStore()
    applied: list[dict[str, float]] = []
    board = Board(store, Names("k", "k:version"), applied.append)
    await store.set_value("k", "not json")
    assert await board.update(lambda d: {**d, "a": 1e12}) == {"a": 1e12}
    assert applied == [{"a": 1e12}]
    assert json.loads(await store.get_value("k") or "") == {"a": 1e12}
    await board.poll_once()  # its own change: not applied again
    assert applied == [{"a": 1e12}] and board.updates == 1


async def test_an_expiry_that_passed_is_applied_without_a_store_change() -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    applied: list[dict[str, float]] = []
    board = Board(store, Names("k", "k:version"), applied.append, wall=clock.wall)
    await board.update(lambda d: {"short": 1010.0, "long": 2000.0})
    await board.poll_once()
    assert len(applied) == 1
    clock.advance(10.0)
    await board.poll_once()
    assert applied[-1] == {"long": 2000.0} and board.current == {"long": 2000.0}
