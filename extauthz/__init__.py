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
    from .context import RawRequest, RequestContext
    from .engine import Engine
    from .errors import (
        CircuitOpen,
        ExtauthzError,
        PolicyError,
        PolicyIssue,
        StoreError,
        StoreInternalError,
        StoreTimeout,
        StoreUnavailable,
    )
    from .policy import Policy, load_policy
    from .store.base import Store
    from .store.memory import MemoryStore
    from .store.redis import RedisStore
    from .storegate import StoreGate
    from .tiers import Tier
    from .verdict import Decision, Mode, Outcome, Verdict

#: public name -> the module that defines it
_HOMES = {
    "Engine": ".engine",
    "Policy": ".policy",
    "load_policy": ".policy",
    "RawRequest": ".context",
    "RequestContext": ".context",
    "Decision": ".verdict",
    "Verdict": ".verdict",
    "Outcome": ".verdict",
    "Mode": ".verdict",
    "Tier": ".tiers",
    "Store": ".store.base",
    "MemoryStore": ".store.memory",
    "RedisStore": ".store.redis",
    "StoreGate": ".storegate",
    "ExtauthzError": ".errors",
    "PolicyError": ".errors",
    "PolicyIssue": ".errors",
    "StoreError": ".errors",
    "StoreTimeout": ".errors",
    "StoreUnavailable": ".errors",
    "CircuitOpen": ".errors",
    "StoreInternalError": ".errors",
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
