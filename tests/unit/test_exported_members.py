"""The public surface: what ``extauthz.__all__`` names (as httpx pins its own)."""

from __future__ import annotations

import subprocess
import sys

import extauthz

EXPECTED = [
    "CircuitOpen", "Decision", "Engine", "ExtauthzError", "MemoryStore", "Mode", "Outcome",
    "Policy", "PolicyError", "PolicyIssue", "RawRequest", "RedisStore", "RequestContext",
    "Store", "StoreError", "StoreGate", "StoreInternalError", "StoreTimeout", "StoreUnavailable", "Tier",
    "Verdict", "__version__", "load_policy",
]


def test_all_is_pinned_and_sorted() -> None:
    assert extauthz.__all__ == EXPECTED
    assert extauthz.__all__ == sorted(extauthz.__all__)


def test_every_exported_name_is_the_object_its_module_defines() -> None:
    from extauthz.core.context import RawRequest
    from extauthz.core.errors import StoreError
    from extauthz.core.verdict import Decision
    from extauthz.engine.engine import Engine
    from extauthz.policy.loader import load_policy
    from extauthz.store.memory import MemoryStore
    from extauthz.store.redis import RedisStore

    for name in extauthz.__all__:
        assert getattr(extauthz, name) is not None, name
        assert name in dir(extauthz)
    assert extauthz.Engine is Engine and extauthz.load_policy is load_policy
    assert extauthz.MemoryStore is MemoryStore and extauthz.RedisStore is RedisStore
    assert extauthz.Decision is Decision and extauthz.RawRequest is RawRequest
    assert issubclass(extauthz.StoreError, extauthz.ExtauthzError) and extauthz.StoreError is StoreError
    assert isinstance(extauthz.__version__, str)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from extauthz import *", namespace)  # the import under test
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(EXPECTED)


def test_import_is_cheap_and_grpc_free() -> None:
    """``import extauthz`` loads neither grpc nor the Redis client; the engine needs no grpc."""
    code = ("import sys, extauthz; assert 'grpc' not in sys.modules and 'redis' not in sys.modules;"
            "extauthz.Engine; assert 'grpc' not in sys.modules, 'the engine imported grpc'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
