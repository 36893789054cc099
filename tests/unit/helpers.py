"""Small builders for unit tests: policies from dicts, requests, engines on a clock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import Policy, load_policy
from extauthz.store.base import StoreBase
from extauthz.store.memory import MemoryStore


def policy_from(tmp_path: Path, doc: dict[str, Any], name: str = "policy.yaml") -> Policy:
    f = tmp_path / name
    doc = {"identity": [{"header": "x-api-key"}, {"source_ip": True}], **doc}
    f.write_text(yaml.safe_dump({"version": 1, **doc}))
    return load_policy([f])


def engine_for(policy: Policy, clock: ManualClock, **kw: Any) -> tuple[Engine, MemoryStore]:
    """An engine on a memory store on ``clock``; ``deadline``, ``breaker`` and ``store_check``
    go to its :class:`StoreGate`, the rest to the engine."""
    store = MemoryStore(clock)
    gate = {name: kw.pop(name) for name in ("deadline", "breaker", "store_check") if name in kw}
    return Engine(StoreGate(store, clock=clock, **gate), policy, **kw), store


def get(path: str = "/v1/customers", key: str = "sk_live_alice", **kw: Any) -> RawRequest:
    headers = dict(kw.pop("headers", {}))
    if key:
        headers["x-api-key"] = key
    return RawRequest(method=kw.pop("method", "GET"), path=path, headers=headers, **kw)


#: a request_rate limiter (the seed gist's numbers)
RATE = {"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500}


async def allowed_count(engine, n: int, **kw) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for _ in range(n):
        _, decision = await engine.check(get(**kw))
        total += decision.allowed
    return total


class FaultyStore(StoreBase):
    """A real :class:`MemoryStore` behind the store contract, with injectable faults: a
    ``check`` or ``release`` that raises ``check_error`` / ``release_error``, and releases
    that go through the event loop (``release_delay``), as on Redis (not ``immediate``: the
    capabilities are :class:`StoreBase`'s, a store without any)."""

    name = "faulty"

    def __init__(self, inner: MemoryStore, *, check_error: BaseException | None = None,
                 release_error: BaseException | None = None, release_delay: float = 0.0) -> None:
        self.inner = inner
        self.check_error = check_error
        self.release_error = release_error
        self.release_delay = release_delay
        self.releases = 0
        self.closed = False

    async def check(self, ops: Any, lease_id: str) -> Any:
        if self.check_error is not None:
            raise self.check_error
        return await self.inner.check(ops, lease_id)

    async def release(self, keys: Any, lease_id: str) -> int:
        await asyncio.sleep(self.release_delay)
        assert not self.closed, "released after the store was closed"
        if self.release_error is not None:
            raise self.release_error
        self.releases += 1
        return await self.inner.release(keys, lease_id)

    async def close(self) -> None:
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
