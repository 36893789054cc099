"""``classification.route_metadata: {namespace, path}``: where the route's metadata names
the tier, through the gRPC edge (a path may index a list, as Envoy Gateway files a route's
annotations); ``route_metadata_namespace: NS`` is its short form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extauthz.core.errors import PolicyError
from extauthz.core.tiers import Tier
from extauthz.policy import Policy
from extauthz.policy.classify import Classifier, path_value
from extauthz.proto import auth_pb2
from extauthz.server.edge import raw_request

from .helpers import policy_from

GATEWAY = "envoy-gateway"
TIER_PATH = ["resources", 0, "annotations", "extauthz-tier"]


def check_request(route: dict[str, dict[str, Any]], method: str = "GET") -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path = method, "/v1/things"
    for namespace, value in route.items():
        req.attributes.route_metadata_context.filter_metadata[namespace].update(value)
    return req


def tier_of(policy: Policy, req: auth_pb2.CheckRequest) -> tuple[Tier, str]:
    classifier = Classifier(policy)
    raw = raw_request(req, classifier.needed_headers, policy.needed_route_metadata, classifier.needed_metadata)
    ctx = classifier.context(raw)
    return ctx.tier, ctx.tier_source


def gateway_route(tier: object) -> dict[str, dict[str, Any]]:
    return {GATEWAY: {"resources": [{"kind": "HTTPRoute", "name": "shop", "namespace": "default",
                                     "annotations": {"extauthz-tier": tier}}]}}


def test_a_tier_from_an_envoy_gateway_route_annotation(tmp_path: Path) -> None:
    c = (policy_from(tmp_path, {"classification": {
        "route_metadata": {"namespace": GATEWAY, "path": TIER_PATH}}}))
    assert tier_of(c, check_request(gateway_route("critical"))) == (Tier.CRITICAL, "route_metadata")
    # no annotation, a list too short, a number, the default namespace: the method default
    assert tier_of(c, check_request({GATEWAY: {"resources": [{"kind": "HTTPRoute"}]}})) == (Tier.GET, "default")
    assert tier_of(c, check_request({GATEWAY: {"resources": []}}, "POST")) == (Tier.POST, "default")
    assert tier_of(c, check_request(gateway_route(3))) == (Tier.GET, "default")
    assert tier_of(c, check_request({"extauthz": {"tier": "critical"}})) == (Tier.GET, "default")


def test_the_short_form_and_the_default(tmp_path: Path) -> None:
    short = policy_from(tmp_path, {"classification": {"route_metadata_namespace": "mine"}})
    assert short.route_metadata == ("mine", ("tier",))
    assert tier_of(short, check_request({"mine": {"tier": "critical"}})) == (Tier.CRITICAL, "route_metadata")
    assert tier_of(short, check_request({"extauthz": {"tier": "critical"}})) == (Tier.GET, "default")
    default = policy_from(tmp_path, {})
    assert tier_of(default, check_request({"extauthz": {"tier": "critical"}})) == (Tier.CRITICAL, "route_metadata")


def test_both_forms_are_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        policy_from(tmp_path, {"classification": {"route_metadata_namespace": "mine", "route_metadata": {
            "namespace": GATEWAY, "path": TIER_PATH}}})
    assert str(err.value).endswith("classification: set 'route_metadata' or its short form "
                                   "'route_metadata_namespace', not both")


@pytest.mark.parametrize("path", [[], ["a", -1], ["a", True], ["a", ""]])
def test_bad_paths_are_policy_errors(tmp_path: Path, path: list[object]) -> None:
    with pytest.raises(PolicyError, match=r"classification\.route_metadata\.path"):
        policy_from(tmp_path, {"classification": {"route_metadata": {"namespace": GATEWAY, "path": path}}})


def test_path_value_walks_keys_and_indexes_of_dicts_and_structs() -> None:
    plain = {"resources": [{"annotations": {"t": "x"}}], "s": "abc"}
    struct = check_request({"ns": plain}).attributes.route_metadata_context.filter_metadata["ns"]
    for node in (plain, struct):
        assert path_value(node, ["resources", 0, "annotations", "t"]) == "x"
        assert path_value(node, ["resources", 1, "annotations", "t"]) is None
        assert path_value(node, ["resources", "0"]) is None  # a key is not an index
        assert path_value(node, ["s", 0]) is None  # strings are not indexed
        assert path_value(node, ["missing"]) is None
