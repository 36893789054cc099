"""Identity from authentication: ``metadata`` (e.g. jwt_authn's verified payload) and
``principal`` (the mTLS peer) identity rules, through the edge and the classifier."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import struct_pb2

from extauthz.core.context import RawRequest
from extauthz.core.tiers import Tier
from extauthz.policy import load_policy
from extauthz.policy.classify import Classifier, identity_text, scalars_at
from extauthz.policy.model import DEFAULT_ROUTE_TIER
from extauthz.proto import auth_pb2
from extauthz.server.edge import raw_request

from .helpers import policy_from

JWT = "envoy.filters.http.jwt_authn"
RULES = [
    {"metadata": {"namespace": JWT, "path": ["payload", "sub"]}},
    {"principal": True},
    {"header": "x-api-key"},
]


def check_request(*, payload: dict[str, object] | None = None, principal: str = "",
                  headers: dict[str, str] | None = None) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path = "GET", "/v1/things"
    http.headers.update(headers or {})
    req.attributes.source.principal = principal
    req.attributes.source.address.socket_address.address = "10.0.0.7"
    if payload is not None:
        req.attributes.metadata_context.filter_metadata[JWT].update({"payload": payload})
    return req


@pytest.fixture
def classifier(tmp_path: Path) -> Classifier:
    return Classifier(policy_from(tmp_path, {"identity": RULES}))


def context(classifier: Classifier, req: auth_pb2.CheckRequest):  # type: ignore[no-untyped-def]
    raw = raw_request(req, classifier.needed_headers, (DEFAULT_ROUTE_TIER,), classifier.needed_metadata)
    return raw, classifier.context(raw)


def test_principal_from_a_check_request(tmp_path: Path) -> None:
    c = Classifier(policy_from(tmp_path, {"identity": [{"principal": True}, {"source_ip": True}]}))
    spiffe = "spiffe://cluster.local/ns/shop/sa/checkout"
    raw, ctx = context(c, check_request(principal=spiffe))
    assert raw.principal == spiffe
    assert ctx.identity_source == "principal"
    other = context(c, check_request(principal="spiffe://cluster.local/ns/shop/sa/cart"))[1]
    assert other.identity != ctx.identity
    # no principal (plaintext peer): the next rule names the user
    assert context(c, check_request())[1].identity_source == "source_ip"


def test_first_match_order_metadata_principal_header(classifier: Classifier) -> None:
    _, ctx = context(classifier, check_request(payload={"sub": "alice"}, principal="spiffe://a",
                                               headers={"x-api-key": "k"}))
    assert ctx.identity_source == f"metadata:{JWT}:payload.sub"
    _, ctx = context(classifier, check_request(principal="spiffe://a", headers={"x-api-key": "k"}))
    assert ctx.identity_source == "principal"
    _, ctx = context(classifier, check_request(headers={"x-api-key": "k"}))
    assert ctx.identity_source == "header:x-api-key"
    _, ctx = context(classifier, check_request(payload={"sub": {"nested": 1}}, headers={"x-api-key": "k"}))
    assert ctx.identity_source == "header:x-api-key"  # a struct is not an identity


def test_two_subjects_two_identities_same_subject_same_identity(classifier: Classifier) -> None:
    a1 = context(classifier, check_request(payload={"sub": "alice"}))[1]
    a2 = context(classifier, check_request(payload={"sub": "alice", "iat": 7}))[1]
    b = context(classifier, check_request(payload={"sub": "bob"}))[1]
    assert a1.identity == a2.identity != b.identity
    assert "alice" not in a1.identity  # hashed


@pytest.mark.parametrize(("value", "text"), [
    ("u_1", "u_1"), (42.0, "42"), (42, "42"), (-3.0, "-3"), (1.5, "1.5"), (True, ""), (False, ""),
    (float("nan"), ""), (float("inf"), ""), (None, ""), ([1], ""), ({"a": 1}, ""),
])
def test_metadata_value_as_identity_text(value: object, text: str) -> None:
    assert identity_text(value) == text


def test_numbers_through_a_struct_are_decimal_text(classifier: Classifier) -> None:
    raw, ctx = context(classifier, check_request(payload={"sub": 42}))
    assert raw.metadata == {JWT: {"payload": {"sub": 42.0}}}
    assert ctx.identity == context(classifier, check_request(payload={"sub": "42"}))[1].identity


def test_edge_extracts_only_the_named_paths() -> None:
    struct = struct_pb2.Struct()
    struct.update({"payload": {"sub": "alice", "email": "a@example.com", "groups": ["x"],
                               "org": {"id": 7, "tier": True}}, "header": {"alg": "RS256"}})
    got = scalars_at(struct, [("payload", "sub"), ("payload", "org", "id"), ("payload", "groups"),
                                ("payload", "sub", "deeper"), ("missing", "x")])
    assert got == {"payload": {"sub": "alice", "org": {"id": 7.0}}}


def test_namespaces_the_policy_does_not_name_are_not_read(classifier: Classifier) -> None:
    req = check_request(payload={"sub": "alice"})
    req.attributes.metadata_context.filter_metadata["other.filter"].update({"sub": "mallory"})
    raw, _ = context(classifier, req)
    assert set(raw.metadata) == {JWT}
    assert classifier.needed_metadata == {JWT: (("payload", "sub"),)}


def test_policy_without_metadata_rules_reads_no_metadata(tmp_path: Path) -> None:
    c = Classifier(policy_from(tmp_path, {}))
    raw, _ = context(c, check_request(payload={"sub": "alice"}))
    assert raw.metadata == {}


def test_test_mode_from_a_claim(tmp_path: Path) -> None:
    c = Classifier(policy_from(tmp_path, {"identity": RULES, "test_mode": {
        "metadata": {"namespace": JWT, "path": ["payload", "livemode"], "equals": False},
        "key_prefix": "spiffe://cluster.local/ns/test/"}}))
    assert c.needed_metadata == {JWT: (("payload", "sub"), ("payload", "livemode"))}
    test = context(c, check_request(payload={"sub": "alice", "livemode": False}))[1]
    assert (test.test_mode, test.tier) == (True, Tier.TEST)
    live = context(c, check_request(payload={"sub": "alice", "livemode": True}))[1]
    assert not live.test_mode
    # a string "false" is not the boolean false
    assert not context(c, check_request(payload={"sub": "alice", "livemode": "false"}))[1].test_mode
    # key_prefix applies to principals too (a test namespace in the mesh)
    assert context(c, check_request(principal="spiffe://cluster.local/ns/test/sa/x"))[1].test_mode


def test_raw_request_fields_are_general(classifier: Classifier) -> None:
    """The HTTP front door fills the same fields from a JSON payload (ints stay ints)."""
    raw = RawRequest(method="GET", path="/", metadata={JWT: {"payload": {"sub": 42}}})
    assert classifier.context(raw).identity == context(classifier, check_request(payload={"sub": 42}))[1].identity


def test_policy_labels_and_needs(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"identity": RULES})
    assert [s.label for s in policy.identity] == [f"metadata:{JWT}:payload.sub", "principal", "header:x-api-key"]
    assert load_policy([tmp_path / "policy.yaml"]).needed_headers == {"x-api-key"}


def test_json_schema_knows_both_new_rules() -> None:
    import json

    import jsonschema

    from ..conftest import ROOT

    schema = json.loads((ROOT / "docs" / "policy.schema.json").read_text())
    good = {"version": 1, "identity": RULES,
            "test_mode": {"metadata": {"namespace": JWT, "path": ["payload", "livemode"], "equals": False}}}
    jsonschema.validate(good, schema)
    for bad in ({"metadata": {"namespace": JWT}}, {"metadata": {"namespace": JWT, "path": []}},
                {"principal": True, "colour": "red"}, {"metadata": {"namespace": JWT, "path": ["a"], "x": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"version": 1, "identity": [bad]}, schema)
