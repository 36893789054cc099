"""extauthz: an Envoy external authorization server that rate limits and sheds load.

The engine (classification, limiters, shedders, stores) is plain Python and does not
import grpc; only :mod:`extauthz.server` speaks Envoy's protocols.

The public surface is ``__all__`` below (pinned by ``tests/unit/test_exported_members.py``):
other code imports these names from ``extauthz``; every other module is internal and may
change. Names are loaded on first use, so ``import extauthz`` stays cheap and the Redis
client is imported only when :class:`RedisStore` is.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .core.context import RawRequest, RequestContext
    from .core.errors import (
        CircuitOpen,
        ExtauthzError,
        PolicyError,
        PolicyIssue,
        StoreError,
        StoreInternalError,
        StoreTimeout,
        StoreUnavailable,
    )
    from .core.tiers import Tier
    from .core.verdict import Decision, Mode, Outcome, Verdict
    from .engine.engine import Engine
    from .engine.storegate import StoreGate
    from .policy import Policy, load_policy
    from .store.base import Store
    from .store.memory import MemoryStore
    from .store.redis import RedisStore

#: public name -> the module that defines it
_HOMES = {
    "Engine": ".engine.engine",
    "Policy": ".policy",
    "load_policy": ".policy",
    "RawRequest": ".core.context",
    "RequestContext": ".core.context",
    "Decision": ".core.verdict",
    "Verdict": ".core.verdict",
    "Outcome": ".core.verdict",
    "Mode": ".core.verdict",
    "Tier": ".core.tiers",
    "Store": ".store.base",
    "MemoryStore": ".store.memory",
    "RedisStore": ".store.redis",
    "StoreGate": ".engine.storegate",
    "ExtauthzError": ".core.errors",
    "PolicyError": ".core.errors",
    "PolicyIssue": ".core.errors",
    "StoreError": ".core.errors",
    "StoreTimeout": ".core.errors",
    "StoreUnavailable": ".core.errors",
    "CircuitOpen": ".core.errors",
    "StoreInternalError": ".core.errors",
}

__all__ = [
    "CircuitOpen",
    "Decision",
    "Engine",
    "ExtauthzError",
    "MemoryStore",
    "Mode",
    "Outcome",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "RawRequest",
    "RedisStore",
    "RequestContext",
    "Store",
    "StoreError",
    "StoreGate",
    "StoreInternalError",
    "StoreTimeout",
    "StoreUnavailable",
    "Tier",
    "Verdict",
    "__version__",
    "load_policy",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'extauthz' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
