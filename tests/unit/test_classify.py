"""Identity extraction and tier precedence: test mode, route metadata, context
extensions, rules, defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.core.context import RawRequest
from extauthz.core.tiers import Tier
from extauthz.policy import load_policy
from extauthz.policy.classify import Classifier, hash_identity

from ..conftest import ROOT
from .helpers import policy_from


@pytest.fixture
def classifier() -> Classifier:
    return Classifier(load_policy([ROOT / "policies"]))


def req(method: str = "GET", path: str = "/v1/things", **kw: object) -> RawRequest:
    return RawRequest(method=method, path=path, **kw)  # type: ignore[arg-type]


def test_defaults_by_method(classifier: Classifier) -> None:
    for method, tier in [("GET", Tier.GET), ("HEAD", Tier.GET), ("OPTIONS", Tier.GET),
                         ("POST", Tier.POST), ("DELETE", Tier.POST), ("patch", Tier.POST)]:
        ctx = classifier.context(req(method))
        assert (ctx.tier, ctx.tier_source) == (tier, "default")


def test_rules_apply_when_the_route_names_no_tier(classifier: Classifier) -> None:
    ctx = classifier.context(req("POST", "/v1/charges/ch_1"))
    assert (ctx.tier, ctx.tier_source) == (Tier.CRITICAL, "rule[0]")
    assert classifier.context(req("GET", "/v1/charges")).tier is Tier.GET  # rule is POST only


def test_context_extensions_beat_rules(classifier: Classifier) -> None:
    ctx = classifier.context(req("POST", "/v1/charges", context_extensions={"tier": "get"}))
    assert (ctx.tier, ctx.tier_source) == (Tier.GET, "context_extensions")


def test_route_metadata_beats_context_extensions(classifier: Classifier) -> None:
    ctx = classifier.context(req("GET", "/v1/x", route_tier="critical", context_extensions={"tier": "get"}))
    assert (ctx.tier, ctx.tier_source) == (Tier.CRITICAL, "route_metadata")


def test_test_mode_beats_everything(classifier: Classifier) -> None:
    by_key = classifier.context(req("POST", "/v1/charges", route_tier="critical",
                                    headers={"x-api-key": "sk_test_123"}))
    assert (by_key.tier, by_key.tier_source, by_key.test_mode) == (Tier.TEST, "test_mode", True)
    by_header = classifier.context(req("GET", headers={"x-test-mode": "TRUE", "x-api-key": "sk_live_1"}))
    assert by_header.tier is Tier.TEST
    live = classifier.context(req("GET", headers={"x-test-mode": "false", "x-api-key": "sk_live_1"}))
    assert live.tier is Tier.GET and not live.test_mode


def test_unknown_tier_names_are_ignored_and_counted(classifier: Classifier) -> None:
    ctx = classifier.context(req("POST", "/v1/x", route_tier="urgent", context_extensions={"tier": "vip"}))
    assert (ctx.tier, ctx.tier_source) == (Tier.POST, "default")
    assert classifier.unknown_tiers == 2


def test_identity_rules_in_order(classifier: Classifier) -> None:
    key = classifier.context(req(headers={"x-api-key": "sk_live_k", "authorization": "Bearer tok"},
                                 source_ip="10.0.0.1"))
    assert key.identity_source == "header:x-api-key"
    assert key.identity == hash_identity("sk_live_k", "header:x-api-key")
    bearer = classifier.context(req(headers={"authorization": "bearer  tok"}, source_ip="10.0.0.1"))
    assert bearer.identity_source == "header:authorization"
    assert bearer.identity == hash_identity("tok", "header:authorization")
    basic = classifier.context(req(headers={"authorization": "Basic abc"}, source_ip="10.0.0.1"))
    assert basic.identity_source == "source_ip"  # strip_prefix not matched: rule yields nothing
    anon = classifier.context(req())
    assert anon.identity_source == "none"


def test_test_key_prefix_applies_to_bearer_tokens(classifier: Classifier) -> None:
    ctx = classifier.context(req(headers={"authorization": "Bearer sk_test_abc"}))
    assert ctx.tier is Tier.TEST


def test_identity_is_hashed_never_raw(classifier: Classifier) -> None:
    ctx = classifier.context(req(headers={"x-api-key": "sk_live_secret"}))
    assert "sk_live_secret" not in ctx.identity and len(ctx.identity) == 24
    salted = Classifier(load_policy([ROOT / "policies"]), salt=b"pepper").context(
        req(headers={"x-api-key": "sk_live_secret"}))
    assert salted.identity != ctx.identity


def test_rules_on_host_and_headers(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"classification": {"rules": [
        {"match": {"hosts": ["admin.example.com"]}, "tier": "critical"},
        {"match": {"headers": {"x-priority": "low"}, "methods": ["post"]}, "tier": "get"},
    ]}, "identity": [{"header": "x-user"}]})
    c = Classifier(policy)
    assert c.context(req("GET", host="Admin.Example.com:8443")).tier is Tier.CRITICAL
    assert c.context(req("POST", headers={"x-priority": "low"})).tier is Tier.GET
    assert c.context(req("POST", headers={"x-priority": "high"})).tier is Tier.POST
    assert c.needed_headers == {"x-user", "x-priority"}


def test_raw_values_stay_out_of_repr(classifier: Classifier) -> None:
    """A log line or exception message that formats a request must not carry the API key,
    the Authorization value or a JWT claim: those fields are left out of repr."""
    raw = req(headers={"x-api-key": "sk_live_SECRETrepr", "authorization": "Bearer SECRETtoken"},
              metadata={"envoy.filters.http.jwt_authn": {"payload": {"sub": "SECRETsub"}}},
              principal="spiffe://SECRETpeer")
    ctx = classifier.context(raw)
    assert ctx.identity == hash_identity("sk_live_SECRETrepr", "header:x-api-key")
    for text in (repr(raw), repr(ctx), str(ctx), f"{raw!r} {ctx}"):
        assert "SECRET" not in text, text


def test_one_identity_hash_check_everywhere() -> None:
    """Three copies of the hash pattern disagreed: overrides' ``^...$`` with ``.match``
    accepted a trailing newline (a stored identity no request hashes to)."""
    from extauthz.control.overrides import OverrideError, make_override
    from extauthz.policy.classify import normal_hash, valid_hash

    good = hash_identity("alice", "header:x-api-key")
    assert valid_hash(good) and normal_hash(f" {good.upper()}\n") == good
    assert not valid_hash(good + "\n") and not valid_hash(good.upper()) and normal_hash("sk_live_x") is None
    assert make_override("user-rate", good, {"rate": 1}, ttl=60, now=0).identity == good
    with pytest.raises(OverrideError, match="24 hex digits"):
        make_override("user-rate", good + "\n", {"rate": 1}, ttl=60, now=0)
