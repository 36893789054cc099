"""Bounded event logs on Redis: the Redis side of ``Store.append_events``/``read_events``.

A log is one Redis stream (one key, so one slot on a cluster). Each entry has one field,
``e``, holding a JSON string. Appends trim with ``MAXLEN ~`` (cheap, approximate: Redis
keeps at least ``maxlen`` and trims whole radix-tree nodes) and refresh the key's TTL, so an
idle log disappears. Entry ids are Redis server milliseconds, so ``read_events`` selects by
time with ``XRANGE``: the fleet shares Redis's clock.

Plain functions taking a ``redis.asyncio`` client (standalone, cluster or a Sentinel master)
so :class:`extauthz.store.redis.RedisStore` delegates to them and the CLI can call them
with a client of its own. Client errors are wrapped into :class:`~extauthz.core.errors.StoreError`
by the Redis store's one wrapper (:func:`extauthz.store.redis.wire.wrap`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .redis.wire import CLIENT_ERRORS, wrap

FIELD = "e"
#: at most this many entries per read (the log is bounded anyway; this bounds one reply).
READ_BATCH = 10_000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def append_events(client: Any, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
    """XADD every event (``MAXLEN ~ maxlen``) and EXPIRE the stream, in one round trip."""
    if not events:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(key, {FIELD: event}, maxlen=maxlen, approximate=True)
        pipe.expire(key, max(1, math.ceil(ttl)))
        await pipe.execute()
    except CLIENT_ERRORS as exc:
        raise wrap(exc) from exc


async def read_events(client: Any, key: str, since: float) -> list[str]:
    """The events appended at or after ``since`` (Unix seconds), oldest first."""
    start = f"{max(0, math.floor(since * 1000))}-0"
    out: list[str] = []
    try:
        while True:
            entries = await client.xrange(key, min=start, max="+", count=READ_BATCH)
            for _id, fields in entries:
                value = fields.get(FIELD, fields.get(FIELD.encode()))
                if value is not None:
                    out.append(_text(value))
            if len(entries) < READ_BATCH:
                return out
            start = f"({_text(entries[-1][0])}"  # exclusive: after the last one read
    except CLIENT_ERRORS as exc:
        raise wrap(exc) from exc
