"""Keys and a wait shared by the Redis store's tests (split from one file by module)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from extauthz.store.keys import Keys

K = Keys("t")


BUCKET = K.bucket("rate", "bob")


USER_LEASES = K.user_leases("conc", "bob")


FLEET = K.fleet_leases("fleet", "other")


async def wait_until(predicate: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out after {within}s waiting for {what}"
        await asyncio.sleep(0.02)

