"""What only the tests and the benchmarks need of the package, kept out of it (issue 30):
a release awaited to its count, the embedded store's key count and its FLUSHALL, traffic
files written, one stored document changed without a server (the store contract's race
test)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from extauthz.control.overrides import Override, OverrideDocument
from extauthz.control.switches import SwitchDocument, Switches, valid_name, with_switch
from extauthz.core.verdict import Mode
from extauthz.engine.engine import Engine
from extauthz.engine.release import Releaser
from extauthz.engine.state import (
    FailOpenPart,
    GrantsPart,
    ModesPart,
    OverridesPart,
    Part,
    PolicyPart,
    ReleasesPart,
    ShedPart,
    StorePart,
    classifier_part,
)
from extauthz.policy.descriptors import DescriptorTable, Entries, Target, replaced
from extauthz.store.base import Store
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore


async def release_and_wait(releaser: Releaser, keys: Sequence[str], lease_id: str, path: str) -> int:
    """:meth:`Releaser.release`, awaited: the leases it gave back (0 on an error, counted),
    read as the change of ``releaser.leases_released`` (one release at a time: a test's)."""
    before = releaser.leases_released
    task = releaser.release(keys, lease_id, path)
    if task is not None:
        await task
    return releaser.leases_released - before


def key_count(store: MemoryStore) -> int:
    """Every key the embedded store holds: buckets, lease sets, values, shed states, events."""
    return (len(store._buckets) + len(store._leases) + len(store._values) + len(store._shed)
            + len(store._events))


def flushall(store: MemoryStore) -> None:
    """Forget every key of the embedded store, as Redis ``FLUSHALL`` (or a restart without
    persistence) does: the quota ledger's tests lose its data with it."""
    for table in (store._buckets, store._leases, store._slices, store._values, store._shed, store._events,
                  store._held, store.evictions):
        table.clear()
    store._due.clear()
    for scheduled in store._scheduled:
        scheduled.clear()
    store._rotation.clear()


def write_lines(path: str | Path, lines: Sequence[Mapping[str, Any]]) -> Path:
    """Write JSON lines (traffic for ``extauthz simulate``); ``.gz`` compresses."""
    path = Path(path)
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


async def change_switches(store: Store, key: str, name: str, mode: Mode | None) -> Switches:
    """Set (or with None clear) one switch in the store, as
    :class:`~extauthz.control.control.StoreControl` does for the admin port and the CLI: a
    compare-and-set (:meth:`~extauthz.control.documents.Document.change`), so two operators
    flipping switches at once both land. Raises StoreError, ValueError (bad name)."""
    if not valid_name(name):
        raise ValueError(f"bad switch name {name!r}")
    new, _ = await SwitchDocument(key).change(store, lambda current: with_switch(current, name, mode), 0.0)
    return new


async def change_overrides(store: Store, keys: Keys, change: Callable[[list[Override]], list[Override]],
                           now: float) -> list[Override]:
    """Read, change and write the stored overrides (then bump the version key) by the
    document's compare-and-set, as :class:`~extauthz.control.control.StoreControl` does: when
    another operator changed them in between, ``change`` is applied again on top of theirs."""
    result, _ = await OverrideDocument(keys).change(store, change, now)
    return result


def engine_parts(engine: Engine) -> list[Part]:
    """The parts the engine alone reports (the server's panel, server/panel.py, adds its own
    between them)."""
    return [PolicyPart(engine), StorePart(engine), FailOpenPart(engine), ModesPart(engine),
            OverridesPart(engine), ShedPart(engine), ReleasesPart(engine), GrantsPart(engine),
            classifier_part(engine)]


def resolve(table: DescriptorTable, domain: str, descriptors: Sequence[Entries]) -> list[Target | None]:
    """Each descriptor's target, as server/rls.py finds them: ``lookup`` each, then ``replaces``
    applied across them (unlimited targets kept)."""
    return replaced([table.lookup(domain, d) for d in descriptors])
