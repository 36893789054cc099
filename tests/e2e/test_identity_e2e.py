"""Identity from jwt_authn metadata through a real Envoy (envoy/envoy-jwt.yaml): a token
signed here, a local JWKS, separate buckets per subject, a bad signature refused by Envoy
before any Check, and no token falling through to the next identity rule."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jwt
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack
from extauthz.envoy.config import JwtProvider

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

JWT_CONFIG = ROOT / "envoy" / "envoy-jwt.yaml"
ISSUER, AUDIENCE = "https://issuer.example", "extauthz"

POLICY = {
    "version": 1,
    "identity": [
        {"metadata": {"namespace": "envoy.filters.http.jwt_authn", "path": ["payload", "sub"]}},
        {"header": "x-api-key"},
    ],
    "limiters": [{"name": "per-user", "type": "request_rate", "rate": "1/h", "burst": 2}],
}


class Issuer:
    def __init__(self, kid: str = "test") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.kid = kid

    def jwks(self) -> str:
        jwk = json.loads(ECAlgorithm.to_jwk(self.key.public_key()))
        return json.dumps({"keys": [{**jwk, "kid": self.kid, "alg": "ES256", "use": "sig"}]})

    def token(self, sub: str, **claims: object) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "iat": now, "exp": now + 600, **claims}
        return jwt.encode(body, self.key, algorithm="ES256", headers={"kid": self.kid})


def shipped_provider(jwks: str) -> JwtProvider:
    """envoy/envoy-jwt.yaml's token issuer (its ``iss`` and ``aud``) trusting ``jwks``."""
    config = yaml.safe_load(JWT_CONFIG.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    jwt_filter = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn")
    provider = jwt_filter["typed_config"]["providers"]["issuer"]
    assert (provider["issuer"], provider["audiences"]) == (ISSUER, [AUDIENCE])
    return JwtProvider(ISSUER, (AUDIENCE,), jwks)


@contextmanager
def stack_with_jwt(policy: dict[str, object], issuer: Issuer, tmp: Path) -> Iterator[Stack]:
    """The quick start's stack behind envoy/envoy-jwt.yaml trusting ``issuer``'s keys."""
    (tmp / "policy.yaml").write_text(yaml.safe_dump(policy))
    with Stack([tmp / "policy.yaml"], jwt=shipped_provider(issuer.jwks()), tracing=None) as stack:
        yield stack


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer()


@pytest.fixture(scope="module")
def jwt_stack(issuer: Issuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack_with_jwt(POLICY, issuer, tmp_path_factory.mktemp("jwt")) as stack:
        yield stack


def _ext_authz_calls(stack: Stack) -> int:
    assert stack.envoy is not None
    stats = stack.envoy.stats(r"^http\.ingress_http\.ext_authz\.(ok|denied|error|failure_mode_allowed)$")
    return sum(stats.values())


def test_two_subjects_get_separate_buckets(jwt_stack: Stack, issuer: Issuer, client: HttpClient) -> None:
    def send(token: str) -> int:
        return client.send(jwt_stack.url + "/v1/things", headers={"authorization": f"Bearer {token}"}).status

    alice, bob = issuer.token("alice"), issuer.token("bob")
    assert [send(alice) for _ in range(3)] == [200, 200, 429]
    assert send(issuer.token("alice", jti="another token, same subject")) == 429
    assert [send(bob) for _ in range(3)] == [200, 200, 429]


def test_bad_signature_never_reaches_the_server(jwt_stack: Stack, issuer: Issuer, client: HttpClient) -> None:
    forged = Issuer(kid=issuer.kid).token("carol")  # same kid, another key
    before = _ext_authz_calls(jwt_stack)
    r = client.send(jwt_stack.url + "/v1/things", headers={"authorization": f"Bearer {forged}"})
    assert r.status == 401
    assert _ext_authz_calls(jwt_stack) == before
    assert jwt_stack.envoy is not None
    assert jwt_stack.envoy.stats(r"jwt_authn\.denied$")["http.ingress_http.jwt_authn.denied"] >= 1
    # the genuine token for the same subject still passes
    good = client.send(jwt_stack.url + "/v1/things", headers={"authorization": f"Bearer {issuer.token('carol')}"})
    assert good.status == 200 and _ext_authz_calls(jwt_stack) == before + 1


def test_no_token_falls_to_the_next_rule(jwt_stack: Stack, client: HttpClient) -> None:
    def send(key: str) -> int:
        return client.send(jwt_stack.url + "/v1/things", headers={"x-api-key": key}).status

    assert [send("k1") for _ in range(3)] == [200, 200, 429]
    assert send("k2") == 200  # its own bucket: the header rule named it, not the anonymous bucket
