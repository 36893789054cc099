"""A plan from a verified claim: the issue's example, a ``metadata`` plan rule (jwt_authn's
payload) before the header rule, through the edge and the classifier."""

from __future__ import annotations

from pathlib import Path

from extauthz.policy.classify import Classifier
from extauthz.policy.model import DEFAULT_ROUTE_TIER
from extauthz.proto import auth_pb2
from extauthz.server.edge import raw_request

from .helpers import policy_from

JWT = "envoy.filters.http.jwt_authn"
PLAN = {"from": [{"metadata": {"namespace": JWT, "path": ["payload", "plan"]}}, {"header": "x-plan"}],
        "default": "free"}
LIMITERS = [{"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500,
             "plans": {"free": {"rate": 10, "burst": 50}, "enterprise": {"rate": 1000, "burst": 5000}}}]


def check_request(claims: dict[str, object] | None, headers: dict[str, str]) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path = "GET", "/v1/things"
    http.headers.update(headers)
    if claims is not None:
        req.attributes.metadata_context.filter_metadata[JWT].update({"payload": claims})
    return req


def test_plan_from_metadata_then_header(tmp_path: Path) -> None:
    classifier = Classifier(policy_from(tmp_path, {"plan": PLAN, "limiters": LIMITERS}))
    # the edge copies the claim path the plan rule names (and nothing else)
    assert classifier.needed_metadata == {JWT: (("payload", "plan"),)}

    def plan(claims: dict[str, object] | None, headers: dict[str, str]) -> tuple[str, str]:
        raw = raw_request(check_request(claims, {"x-api-key": "sk_live_a", **headers}),
                          classifier.needed_headers, (DEFAULT_ROUTE_TIER,), classifier.needed_metadata)
        ctx = classifier.context(raw)
        return ctx.plan, ctx.plan_source

    label = f"metadata:{JWT}:payload.plan"
    # the verified claim wins over a header the client may have set
    assert plan({"plan": "enterprise", "sub": "u1"}, {"x-plan": "free"}) == ("enterprise", label)
    assert plan(None, {"x-plan": "enterprise"}) == ("enterprise", "header:x-plan")  # no claim: header
    assert plan({"plan": 7}, {}) == ("free", "unknown")  # a number names no known plan
    assert plan({"sub": "u1"}, {}) == ("free", "default")
    assert classifier.unknown_plans == 1
