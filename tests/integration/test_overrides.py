"""``extauthz override`` against real servers: two replicas sharing one real Redis apply a
change within two seconds (polled, no fixed sleeps), the RateLimit headers show it, it
expires at its TTL and ``clear`` removes it; with the embedded store the admin port takes it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from extauthz.control.overrides import KEY_SLACK, MAX_OVERRIDES, MAX_TTL
from extauthz.core.context import RawRequest
from extauthz.policy import Policy, load_policy
from extauthz.policy.classify import hash_identity
from extauthz.proto import auth_pb2_grpc
from testinfra.redis_servers import RedisSingle
from tests.observe.helpers import SALT, admin, check_request, running, scrape

from .replicas import replicas

POLICY = """\
version: 1
identity:
  - header: x-api-key
plan:
  from: [{header: x-plan}]
  default: free
limiters:
  - name: user-rate
    type: request_rate
    rate: 1
    burst: 10
    plans:
      pro: {rate: 10, burst: 100}
  - name: fleet
    type: fleet_usage
    capacity: 1000
"""
VIP = "sk_live_vip_customer"
#: a change reaches every replica within this (the poll runs every second).
WITHIN = 2.0


def cli(*argv: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extauthz", *argv], capture_output=True, text=True,
                          timeout=60, check=False, input=stdin,
                          env={**os.environ, **(env or {})})


def policy_header(stub: auth_pb2_grpc.AuthorizationStub, key: str, plan: str = "pro") -> str:
    """The RateLimit-Policy header the replica answers for this customer."""
    resp = stub.Check(check_request(headers={"x-api-key": key, "x-plan": plan}), timeout=10)
    headers = (resp.denied_response.headers if resp.HasField("denied_response")
               else resp.ok_response.response_headers_to_add)
    return next(h.header.value for h in headers if h.header.key.lower() == "ratelimit-policy")


def wait_until(predicate: Callable[[], bool], within: float) -> float:
    """Poll until true; the seconds it took. Fails after ``within``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within:
            raise AssertionError(f"not true within {within} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.redis
@pytest.mark.slow
def test_an_override_reaches_two_replicas_on_one_redis(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    env = {"EXTAUTHZ_REDIS_URL": redis_single_clean.url, "EXTAUTHZ_IDENTITY_SALT": SALT}
    args = ["--store-deadline-ms", "2000"]
    with replicas(policy, 2, args=args, env=env, workdir=tmp_path) as stubs:
        plan_numbers = '"user-rate";q=100;w=10'
        assert [policy_header(s, VIP) for s in stubs] == [plan_numbers] * 2

        r = cli("override", "set", "user-rate", "--identity", VIP, "rate=50", "burst=200",
                "--ttl", "6s", "--reason", "launch week", "--by", "tester", env=env)
        assert r.returncode == 0, r.stderr
        hashed = hash_identity(VIP, "header:x-api-key", SALT.encode())
        assert hashed in r.stdout and VIP not in r.stdout + r.stderr  # hashed, never echoed
        set_at = time.monotonic()
        took = wait_until(lambda: all(policy_header(s, VIP) == '"user-rate";q=200;w=4' for s in stubs),
                          WITHIN)
        print(f"override applied by both replicas {took:.2f} s after the CLI returned")
        assert policy_header(stubs[0], "sk_live_other") == plan_numbers  # only that customer

        with redis_single_clean.client() as raw:  # stored hashed, with a TTL
            stored = raw.get("extauthz:overrides")
            assert stored is not None and VIP not in stored and hashed in stored
            assert 0 < raw.pttl("extauthz:overrides") <= (6 + 60) * 1000
            assert 0 < raw.pttl("extauthz:overrides:version") <= (MAX_TTL + KEY_SLACK) * 1000

        r = cli("override", "list", "--policies", str(policy), env=env)
        assert r.returncode == 0, r.stderr
        row = next(line for line in r.stdout.splitlines() if line.startswith("user-rate"))
        for part in (hashed, "burst=200 rate=50", "tester", "yes", "launch week"):
            assert part in row, row
        r = cli("override", "list", "--json", env=env)
        (entry,) = json.loads(r.stdout)["overrides"]
        assert entry["expires_at"] - entry["set_at"] == pytest.approx(6.0)

        # It expires at its TTL (6 s after it was set), on both replicas.
        wait_until(lambda: all(policy_header(s, VIP) == plan_numbers for s in stubs),
                   6.0 + WITHIN + (time.monotonic() - set_at))
        assert time.monotonic() - set_at >= 6.0 - WITHIN  # not before its TTL

        # Set again, then clear: back to the plan everywhere.
        r = cli("override", "set", "user-rate", "--identity", "-", "burst=300", env=env, stdin=VIP + "\n")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: all(policy_header(s, VIP).startswith('"user-rate";q=300;') for s in stubs), WITHIN)
        r = cli("override", "clear", "user-rate", "--identity", VIP, env=env)
        assert r.returncode == 0, r.stderr
        assert "no live overrides" in r.stdout
        wait_until(lambda: all(policy_header(s, VIP) == plan_numbers for s in stubs), WITHIN)
        r = cli("override", "clear", "user-rate", "--identity", VIP, env=env)
        assert r.returncode == 1 and "no override for limiter 'user-rate'" in r.stderr
        assert "hashed for the identity rule header:x-api-key" in r.stderr

        # With the policy at hand the CLI refuses what would not apply.
        r = cli("override", "set", "fleet", "--identity", VIP, "limit=5", "--policies", str(policy), env=env)
        assert r.returncode == 1
        assert "limiter 'fleet' limits the whole fleet and takes no per-customer override" in r.stderr

#: the policy naming customers by a Bearer token instead of x-api-key.
BEARER = POLICY.replace("  - header: x-api-key\n", '  - header: authorization\n    strip_prefix: "Bearer "\n')


@pytest.mark.redis
def test_the_identity_rule_comes_from_the_policy_or_a_warning_says_it_was_guessed(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    # The hash covers the identity rule's label: an override hashed for x-api-key never
    # matches a customer the policy names by its Bearer token. That must not pass silently.
    policy = tmp_path / "policy.yaml"
    policy.write_text(BEARER)
    env = {"EXTAUTHZ_REDIS_URL": redis_single_clean.url, "EXTAUTHZ_IDENTITY_SALT": SALT}
    wrong = hash_identity(VIP, "header:x-api-key", SALT.encode())
    right = hash_identity(VIP, "header:authorization", SALT.encode())

    r = cli("override", "set", "user-rate", "--identity", VIP, "burst=70", env=env)
    assert r.returncode == 0 and wrong in r.stdout, r.stderr
    assert "warning: hashing the identity for the rule header:x-api-key" in r.stderr
    r = cli("override", "list", "--policies", str(policy), env=env)
    row = next(line for line in r.stdout.splitlines() if line.startswith("user-rate"))
    assert wrong in row and " NO " in row, r.stdout
    assert ("not applied: hashed for the identity rule header:x-api-key, which the policy does "
            "not have (its identity rules: header:authorization)") in r.stdout

    # With the policy the rule is the policy's, no warning; an explicit one must be in it.
    r = cli("override", "set", "user-rate", "--identity", VIP, "burst=70", "--policies", str(policy), env=env)
    assert r.returncode == 0 and right in r.stdout and "warning" not in r.stderr, r.stderr
    r = cli("override", "set", "user-rate", "--identity", f"Bearer {VIP}", "burst=70", "--policies", str(policy),
            env=env)  # the whole header value: the rule's strip_prefix is taken off, as the server does
    assert r.returncode == 0 and f"for identity {right} (header:authorization)" in r.stdout, r.stdout
    assert VIP not in r.stdout + r.stderr
    r = cli("override", "set", "user-rate", "--identity", VIP, "burst=70", "--source", "Header:Authorization",
            env=env)
    assert r.returncode == 0 and right in r.stdout and "warning" not in r.stderr, r.stderr
    r = cli("override", "set", "user-rate", "--identity", VIP, "burst=70", "--source", "header:x-api-key",
            "--policies", str(policy), env=env)
    assert r.returncode == 1 and VIP not in r.stdout + r.stderr
    assert ("--source header:x-api-key: the policy has no such identity rule (its identity rules: "
            "header:authorization)") in r.stderr


async def test_the_admin_port_refuses_an_override_hashed_for_a_rule_its_policy_lacks(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(BEARER)
    async with running([policy]) as (server, _):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        env = {"EXTAUTHZ_REDIS_URL": "", "EXTAUTHZ_IDENTITY_SALT": SALT}
        r = await asyncio.to_thread(cli, "override", "set", "user-rate", "--identity", VIP, "burst=70",
                                    "--admin", url, env=env)
        assert r.returncode == 1 and "set it again with --source header:authorization" in r.stderr, r.stderr
        r = await asyncio.to_thread(cli, "override", "set", "user-rate", "--identity", VIP, "burst=70",
                                    "--source", "header:authorization", "--admin", url, env=env)
        assert r.returncode == 0, r.stderr
        assert "(header:authorization)" in r.stdout and f"applied by the server at {url} now" in r.stdout
        raw = RawRequest(method="GET", path="/", headers={"authorization": f"Bearer {VIP}"})
        assert server.engine.context(raw).overrides["user-rate"][""].burst == 70  # the server's hash
        # clearing with the wrong rule finds nothing, and says what the hash was made for
        r = await asyncio.to_thread(cli, "override", "clear", "user-rate", "--identity", VIP,
                                    "--admin", url, env=env)
        assert r.returncode == 1 and VIP not in r.stdout + r.stderr
        assert "no override for limiter 'user-rate' and that identity (hashed for the identity rule " \
               "header:x-api-key; another --source or --identity-salt gives another hash" in r.stderr, r.stderr


async def test_overrides_through_the_admin_port_with_the_embedded_store(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    async with running([policy]) as (server, client):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        env = {"EXTAUTHZ_REDIS_URL": "", "EXTAUTHZ_IDENTITY_SALT": SALT}

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return cli("override", *argv, "--admin", url, env=env)

        r = await asyncio.to_thread(run, "set", "user-rate", "--identity", VIP, "rate=5", "burst=20",
                                    "--reason", "incident 42")
        assert r.returncode == 0, r.stderr
        assert VIP not in r.stdout
        hashed = hash_identity(VIP, "header:x-api-key", SALT.encode())
        # applied at once by the replica that took it
        ctx = server.engine.context(check_request_raw(VIP))
        assert ctx.overrides["user-rate"][""].burst == 20
        assert [await client.check(VIP, headers={"x-plan": "pro"}) for _ in range(21)] == [200] * 20 + [429]

        status, data = await admin(server, "GET", "/overrides")
        assert status == 200 and data["overrides"][0]["identity"] == hashed
        assert data["overrides"][0]["applied"] is True and data["max"] == MAX_OVERRIDES

        r = await asyncio.to_thread(run, "set", "user-rate", "--identity", VIP, "burst=1", "cost=2")
        assert r.returncode == 1
        assert "cost (2) is larger than burst (1): no request could ever pass" in r.stderr
        r = await asyncio.to_thread(run, "set", "nope", "--identity", VIP, "rate=1")
        assert r.returncode == 1 and "the policy has no limiter named 'nope'" in r.stderr

        # A reload that drops the limiter: the override is kept, reported, not applied.
        policy.write_text(POLICY.replace("name: user-rate", "name: user-rate-v2"))
        server.apply_policy(load(policy))
        status, data = await admin(server, "GET", "/status")
        (row,) = data["overrides"]["not_applied"]
        assert row["limiter"] == "user-rate" and row["not_applied"] == (
            "the policy has no limiter named 'user-rate' (did you mean 'user-rate-v2'?)")
        assert 'extauthz_overrides{applied="no"} 1.0' in await scrape(server)
        r = await asyncio.to_thread(run, "list")
        assert "NO" in r.stdout and "not applied: the policy has no limiter named 'user-rate'" in r.stdout
        policy.write_text(POLICY)
        server.apply_policy(load(policy))  # back: applies again
        assert server.engine.context(check_request_raw(VIP)).overrides["user-rate"][""].burst == 20

        r = await asyncio.to_thread(run, "clear", "user-rate", "--identity", VIP)
        assert r.returncode == 0, r.stderr
        assert server.engine.context(check_request_raw(VIP)).overrides == {}


def check_request_raw(key: str) -> RawRequest:
    return RawRequest(method="GET", path="/", headers={"x-api-key": key, "x-plan": "pro"})


def load(path: Path) -> Policy:
    return load_policy([path])


@pytest.mark.slow  # five command runs against a server: about 5 s
async def test_history_shows_the_overrides_that_lapsed(tmp_path: Path) -> None:
    """An override whose TTL ran out is an ``expire`` row of ``extauthz history`` at its expiry;
    one cleared (or set again) before it is not, nor one still live."""
    from extauthz.core.clock import ManualClock

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    clock = ManualClock(time.time() - 7200)  # the server's changes were made two hours ago
    async with running([policy], clock=clock) as (server, _client):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        env = {"EXTAUTHZ_REDIS_URL": "", "EXTAUTHZ_IDENTITY_SALT": SALT}

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return cli(*argv, "--admin", url, env=env)

        set_at = clock.wall()
        for key, ttl in ((VIP, "10m"), ("sk_live_cleared", "1h"), ("sk_live_live", "1d")):
            r = await asyncio.to_thread(run, "override", "set", "user-rate", "--identity", key, "burst=20",
                                        "--ttl", ttl)
            assert r.returncode == 0, r.stderr
        clock.advance(60)
        r = await asyncio.to_thread(run, "override", "clear", "user-rate", "--identity", "sk_live_cleared")
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(run, "history", "--json")
        text = await asyncio.to_thread(run, "history")
    assert r.returncode == 0, r.stderr
    changes = json.loads(r.stdout)["changes"]
    assert [c["action"] for c in changes] == ["set", "set", "set", "clear", "expire"]
    hashed = hash_identity(VIP, "header:x-api-key", SALT.encode())
    lapse = changes[-1]
    assert (lapse["kind"], lapse["target"], lapse["via"]) == ("override", f"user-rate {hashed}", "ttl")
    assert lapse["at"] == pytest.approx(set_at + 600) and changes[0]["expires_at"] == lapse["at"]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lapse["at"]))
    [row] = [line for line in text.stdout.splitlines() if " expire " in line]
    assert row.startswith(f"{when:<20} override expire user-rate {hashed}") and "TTL ran out" in row
