"""The policy examples in docs/policy.md load: every ```yaml block that is policy (not an
Envoy or Istio resource) passes the loader, with ``version: 1`` added when the fragment
leaves it out. A doc example that drifts from the schema fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from extauthz.policy import load_policy

from ..conftest import ROOT

BLOCK = re.compile(r"^( *)```yaml\n(.*?)^\1```", re.S | re.M)
TOP_LEVEL = {"version", "identity", "plan", "test_mode", "classification", "limiters"}


def policy_examples() -> list[str]:
    text = (ROOT / "docs" / "policy.md").read_text()
    out = []
    for m in BLOCK.finditer(text):
        body = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
        doc = yaml.safe_load(body)
        if isinstance(doc, dict) and set(doc) <= TOP_LEVEL:
            out.append(body)
    return out


def test_the_doc_has_policy_examples() -> None:
    assert any("plans:" in body for body in policy_examples())  # the plan example is found


@pytest.mark.parametrize("body", policy_examples())
def test_a_policy_example_loads(tmp_path: Path, body: str) -> None:
    f = tmp_path / "example.yaml"
    f.write_text(body if re.search(r"^version:", body, re.M) else "version: 1\n" + body)
    load_policy([f])


def test_the_commented_key_and_quota_examples_load_uncommented(tmp_path: Path) -> None:
    """policies/keys-and-quotas.yaml: inactive as shipped, valid once uncommented."""
    text = (ROOT / "policies" / "keys-and-quotas.yaml").read_text()
    shipped = load_policy([ROOT / "policies"])
    assert [s.name for s in shipped.limiters] == ["user-rate", "user-concurrency", "fleet", "workers"]
    uncommented = re.sub(r"^#(  .*)$", r"\1", text.replace("limiters: []", "limiters:"), flags=re.M)
    (tmp_path / "api.yaml").write_text((ROOT / "policies" / "api.yaml").read_text())
    (tmp_path / "keys-and-quotas.yaml").write_text(uncommented)
    policy = load_policy([tmp_path])
    assert [s.name for s in policy.limiters][-2:] == ["login-per-ip", "monthly"]
    assert policy.key_index == {"login-per-ip": 0} and policy.keys[0].label == "key:source_ip"
