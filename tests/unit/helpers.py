"""Small builders for unit tests: policies from dicts, requests, engines on a clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extauthz.clock import ManualClock
from extauthz.context import RawRequest
from extauthz.engine import Engine
from extauthz.policy import Policy, load_policy
from extauthz.store.memory import MemoryStore


def policy_from(tmp_path: Path, doc: dict[str, Any], name: str = "policy.yaml") -> Policy:
    f = tmp_path / name
    doc = {"identity": [{"header": "x-api-key"}, {"source_ip": True}], **doc}
    f.write_text(yaml.safe_dump({"version": 1, **doc}))
    return load_policy([f])


def engine_for(policy: Policy, clock: ManualClock, **kw: Any) -> tuple[Engine, MemoryStore]:
    store = MemoryStore(clock)
    return Engine(store, policy, clock=clock, **kw), store


def get(path: str = "/v1/customers", key: str = "sk_live_alice", **kw: Any) -> RawRequest:
    headers = dict(kw.pop("headers", {}))
    if key:
        headers["x-api-key"] = key
    return RawRequest(method=kw.pop("method", "GET"), path=path, headers=headers, **kw)
