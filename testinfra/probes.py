"""What only the tests and the benchmarks need of the package, kept out of it (issue 30):
a release awaited to its count, the embedded store's key count, traffic files written."""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from extauthz.engine.release import Releaser
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


def write_lines(path: str | Path, lines: Sequence[Mapping[str, Any]]) -> Path:
    """Write JSON lines (traffic for ``extauthz simulate``); ``.gz`` compresses."""
    path = Path(path)
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path
