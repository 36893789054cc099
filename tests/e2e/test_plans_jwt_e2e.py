"""A plan from a verified JWT claim through a real Envoy (envoy/envoy-jwt.yaml): two
customers on two plans get their own limits and headers, and a client-set ``x-plan`` header
does not beat the verified claim."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

from .test_identity_e2e import Issuer, stack_with_jwt

pytestmark = pytest.mark.e2e

JWT = "envoy.filters.http.jwt_authn"
POLICY = {
    "version": 1,
    "identity": [{"metadata": {"namespace": JWT, "path": ["payload", "sub"]}}],
    "plan": {"from": [{"metadata": {"namespace": JWT, "path": ["payload", "plan"]}}, {"header": "x-plan"}],
             "default": "free"},
    "limiters": [{"name": "user-rate", "type": "request_rate", "rate": "1/h", "burst": 100,
                  "plans": {"free": {"burst": 2}, "enterprise": {"burst": 5}}}],
}


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer()


@pytest.fixture(scope="module")
def plan_stack(issuer: Issuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack_with_jwt(POLICY, issuer, tmp_path_factory.mktemp("jwt-plans")) as stack:
        yield stack


def test_plans_from_a_verified_claim(plan_stack: Stack, issuer: Issuer, client: HttpClient) -> None:
    def send(token: str, **headers: str) -> tuple[int, str]:
        r = client.send(plan_stack.url + "/v1/things", headers={"authorization": f"Bearer {token}", **headers})
        return r.status, r.headers.get("ratelimit-policy", "")

    ent, free = issuer.token("acme", plan="enterprise"), issuer.token("bob", plan="free")
    got = [send(ent) for _ in range(6)]
    assert [s for s, _ in got] == [200] * 5 + [429]
    assert got[0][1] == '"user-rate";q=5;w=18000'
    # bob's token says free: a forged header does not make it enterprise
    got = [send(free, **{"x-plan": "enterprise"}) for _ in range(3)]
    assert [s for s, _ in got] == [200, 200, 429]
    assert got[0][1] == '"user-rate";q=2;w=7200'
