"""Plans and overrides through a real Envoy (envoy/envoy.yaml, embedded store): two API
keys on two plans get their own limits, headers and problem+json bodies; an override set
with the CLI shows in the next answer's headers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from extauthz.devtools.client import HttpClient, Result
from extauthz.devtools.stack import Stack

from ..conftest import FIXTURES

pytestmark = pytest.mark.e2e

SALT = "e2e-salt"


@pytest.fixture(scope="module")
def plans_stack() -> Iterator[Stack]:
    with Stack([FIXTURES / "policies" / "plans"], server_args=["--identity-salt", SALT]) as stack:
        yield stack


def send(client: HttpClient, stack: Stack, key: str, plan: str) -> Result:
    return client.send(stack.url + "/v1/customers", headers={"x-api-key": key, "x-plan": plan})


def test_two_keys_on_two_plans_get_their_own_limits(client: HttpClient, plans_stack: Stack) -> None:
    free = [send(client, plans_stack, "sk_live_free_one", "free") for _ in range(4)]
    pro = [send(client, plans_stack, "sk_live_pro_one", "pro") for _ in range(4)]
    assert [r.status for r in free] == [200, 200, 200, 429]  # free: burst 3
    assert [r.status for r in pro] == [200] * 4  # pro: burst 500
    assert free[0].headers["ratelimit-policy"].startswith('"user-rate";q=3;w=3,')
    assert pro[0].headers["ratelimit-policy"].startswith('"user-rate";q=500;w=5,')
    assert free[1].headers["ratelimit"].startswith('"user-rate";r=1;')
    # pro refills a token every 10 ms: r=498 when the second request came within 10 ms of the
    # first, 499 when the machine was slower (the remaining count is floored)
    assert pro[1].headers["ratelimit"].startswith(('"user-rate";r=498;', '"user-rate";r=499;'))
    refused = free[-1]
    assert refused.headers["retry-after"] == "1"  # one token at free's 1/s
    assert refused.headers["ratelimit-policy"].startswith('"user-rate";q=3;w=3')
    body = json.loads(refused.body)
    assert body["limit"] == 3 and body["limiter"] == "user-rate"
    assert "bursts of up to 3 requests, refilled at 1 per second" in body["detail"]
    # A plan the policy does not name is the default plan (free).
    r = send(client, plans_stack, "sk_live_guess", "platinum")
    assert r.headers["ratelimit-policy"].startswith('"user-rate";q=3;w=3')


def test_an_override_shows_in_the_next_answer(client: HttpClient, plans_stack: Stack) -> None:
    assert plans_stack.server is not None
    key = "sk_live_free_vip"
    assert send(client, plans_stack, key, "free").headers["ratelimit-policy"].startswith('"user-rate";q=3;')
    env = {**os.environ, "EXTAUTHZ_IDENTITY_SALT": SALT, "EXTAUTHZ_REDIS_URL": ""}
    admin = f"http://127.0.0.1:{plans_stack.server.admin_port}"
    r = subprocess.run([sys.executable, "-m", "extauthz", "override", "set", "user-rate", "--identity", key,
                        "rate=20", "burst=40", "--admin", admin], capture_output=True, text=True, env=env,
                       timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout
    got = send(client, plans_stack, key, "free")
    assert got.headers["ratelimit-policy"].startswith('"user-rate";q=40;w=2')
    assert send(client, plans_stack, "sk_live_free_two", "free").headers["ratelimit-policy"].startswith(
        '"user-rate";q=3;')  # only that customer
