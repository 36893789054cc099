"""Numbers that enter through the operator's tools are finite and bounded, and one bad
override never stops the fleet from being operated.

Through the public interfaces: the ``extauthz`` console script (a subprocess), the admin
port of a real running server, a real Redis and ``extauthz serve`` processes. A value the
current tools refuse is written into Redis the way an older CLI wrote it (``json.dumps``
of ``float("inf")`` is ``Infinity``), which is what a replica then reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from extauthz.devtools.stack import ServerProcess
from extauthz.policy.classify import hash_identity
from extauthz.proto import auth_pb2_grpc
from testinfra.redis_servers import RedisSingle
from tests.observe.helpers import SALT, _open, admin, check_request, running

from .test_overrides import wait_until

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 100
    burst: 1000
  - name: user-concurrency
    type: concurrent_requests
    limit: 20
  - name: fleet
    type: fleet_usage
    capacity: 1000
"""
KEY = "sk_live_numbers"
HASHED = hash_identity(KEY, "header:x-api-key", SALT.encode())
#: the console script installed with the package (what an operator runs)
EXTAUTHZ = str(Path(sys.executable).with_name("extauthz"))


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXTAUTHZ, *argv], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "EXTAUTHZ_IDENTITY_SALT": SALT, **(env or {})})


def get(port: int, path: str) -> Any:
    status, text = _open("GET", f"http://127.0.0.1:{port}{path}")
    assert status == 200, text
    return json.loads(text)


def stored_entry(numbers: str, limiter: str = "user-rate", identity: str = HASHED) -> dict[str, Any]:
    """An override entry as the store holds it, with ``numbers`` as raw JSON text."""
    now = time.time()
    return {"limiter": limiter, "identity": identity, "source": "header:x-api-key",
            "numbers": f"@@{numbers}@@", "reason": "old cli", "by": "someone",
            "set_at": now, "expires_at": now + 3600}


def poison(redis: RedisSingle, *entries: dict[str, Any]) -> None:
    """Write overrides into Redis as an older ``extauthz override set --redis-url`` did."""
    text = json.dumps({"overrides": list(entries)})
    for e in entries:  # the numbers verbatim: Infinity, 1e999, 1e-310
        text = text.replace(json.dumps(e["numbers"]), e["numbers"][2:-2])
    with redis.client() as raw:
        raw.set("extauthz:overrides", text, ex=3600)
        raw.set("extauthz:overrides:version", "poisoned", ex=3600)


# -- the CLI validates before it writes ---------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize(("number", "message"), [
    ("burst=inf", "burst: Input should be a finite number"),
    ("burst=1e999", "burst: Input should be a finite number"),
    ("rate=1e-310", "rate: Input should be greater than or equal to 0.000001"),
    ("burst=1e308", "burst: Input should be less than or equal to 1000000000"),
    ("limit=2000000000", "limit: Input should be less than or equal to 1000000000"),
])
def test_the_cli_refuses_numbers_out_of_bounds_before_it_writes_to_redis(
        redis_single_clean: RedisSingle, number: str, message: str) -> None:
    # --redis-url without --policies: the CLI has no limiter to compile against, and still
    # must not write a number that no replica could apply
    r = cli("override", "set", "user-rate", "--identity", KEY, number, "--source", "header:x-api-key",
            "--redis-url", redis_single_clean.url)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and KEY not in r.stdout + r.stderr
    with redis_single_clean.client() as raw:
        assert raw.get("extauthz:overrides") is None and raw.get("extauthz:overrides:version") is None


# -- one bad stored override stops nothing ------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_a_poisoned_stored_override_is_reported_and_the_fleet_stays_operable(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    other = hash_identity("sk_live_other", "header:x-api-key", SALT.encode())
    poison(redis_single_clean,
           stored_entry('{"burst": Infinity}'),
           stored_entry('{"rate": 1e-310}', identity=other),
           stored_entry('{"limit": 1e999}', limiter="user-concurrency"),
           stored_entry('{"burst": 500}', identity="0" * 24))  # a good one beside them
    env = {"EXTAUTHZ_IDENTITY_SALT": SALT}
    server = ServerProcess([policy], args=["--redis-url", redis_single_clean.url, "--store-deadline-ms", "2000"],
                           env=env, workdir=tmp_path)
    with server:  # a replica (re)starting with the poison stored: it starts
        status = get(server.admin_port, "/status")
        refused = {(r["limiter"], r["identity"]): r["not_applied"] for r in status["overrides"]["not_applied"]}
        assert refused == {
            ("user-rate", HASHED): "stored numbers refused: burst: Input should be a finite number",
            ("user-rate", other): "stored numbers refused: rate: Input should be greater than or equal to 0.000001",
            ("user-concurrency", HASHED): "stored numbers refused: limit: Input should be a finite number",
        }
        assert status["overrides"]["live"] == 4  # the good one applies
        rows = get(server.admin_port, "/overrides")["overrides"]
        assert [r["applied"] for r in rows if r["identity"] == "0" * 24] == [True]
        assert "overrides_not_applied" in server.log()
        listed = cli("override", "list", "--redis-url", redis_single_clean.url, "--policies", str(policy))
        assert listed.returncode == 0, listed.stderr
        assert "not applied: stored numbers refused: burst: Input should be a finite number" in listed.stdout

        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        stub = auth_pb2_grpc.AuthorizationStub(channel)
        try:
            def answer() -> str:
                resp = stub.Check(check_request(headers={"x-api-key": KEY}), timeout=10)
                headers = (resp.denied_response.headers if resp.HasField("denied_response")
                           else resp.ok_response.response_headers_to_add)
                return next((h.header.value for h in headers if h.header.key == "ratelimit-policy"), "")

            assert answer().startswith('"user-rate";q=1000;')  # the poison is not applied

            # The global kill switch applies (it answered 500 and never applied before).
            r = cli("switch", "*", "off", "--admin", f"http://127.0.0.1:{server.admin_port}")
            assert r.returncode == 0, r.stderr
            assert get(server.admin_port, "/switches")["limiters"]["user-rate"]["mode"] == "off"
            assert answer() == ""  # no limiter answers any more
            r = cli("switch", "*", "clear", "--admin", f"http://127.0.0.1:{server.admin_port}")
            assert r.returncode == 0, r.stderr

            # A policy reload applies (it was dropped silently before) and is not a failure.
            policy.write_text(POLICY.replace("burst: 1000", "burst: 900"))
            wait_until(lambda: answer().startswith('"user-rate";q=900;'), 10.0)
            reload = get(server.admin_port, "/status")["reload"]
            assert reload["failures"] == 0 and reload["last_error"] is None and reload["reloads"] == 1

            # The next change through the CLI drops the refused entries and keeps the good one.
            r = cli("override", "set", "user-rate", "--identity", KEY, "burst=50", "--redis-url",
                    redis_single_clean.url, "--policies", str(policy))
            assert r.returncode == 0, r.stderr
            wait_until(lambda: answer().startswith('"user-rate";q=50;'), 10.0)
            with redis_single_clean.client() as raw:
                stored = json.loads(raw.get("extauthz:overrides"))
            assert sorted(e["identity"] for e in stored["overrides"]) == ["0" * 24, HASHED]
            assert get(server.admin_port, "/status")["overrides"]["not_applied"] == []
        finally:
            channel.close()


# -- the admin port: every bad number a 400 with a clear message --------------------------


@pytest.mark.parametrize(("body", "message"), [
    ('{"numbers": {"rate": Infinity}}', "rate: Input should be a finite number"),
    ('{"numbers": {"burst": Infinity}}', "burst: Input should be a finite number"),
    ('{"numbers": {"burst": NaN}}', "burst: Input should be a finite number"),
    ('{"numbers": {"rate": 1e-310}}', "rate: Input should be greater than or equal to 0.000001"),
    ('{"numbers": {"burst": 1e308, "cost": 1e308}}',
     "burst: Input should be less than or equal to 1000000000; cost: Input should be less than or equal to 1000000000"),
    ('{"numbers": {"burst": 1e999}}', "burst: Input should be a finite number"),
    ('{"numbers": {"rate": 0.0001}}', "burst (1000) / rate (0.0001/s): the bucket would take 1e+07 s to refill, "
     "more than 30 days (2.592e+06 s): raise the rate or lower the burst"),
    ('{"numbers": {"burst": 5}, "ttl": 1e999}', "the TTL must be a finite number of seconds"),
    ('{"numbers": {"burst": 5}, "ttl": Infinity}', "the TTL must be a finite number of seconds"),
    ('{"numbers": ' + "[" * 5_000 + "]" * 5_000 + "}", "the JSON is nested too deeply"),
    ("[" * 20_000, "the JSON is nested too deeply"),
    ("[" * 100_000, "the body is larger than 65536 bytes"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
])
async def test_the_admin_port_answers_400_to_bad_numbers(tmp_path: Path, body: str, message: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    async with running([policy]) as (server, _):
        status, data = await admin(server, "PUT", f"/overrides/user-rate/{HASHED}", body)
        assert status == 400 and message in data["error"], data
        assert "Traceback" not in data["error"]
        status, data = await admin(server, "GET", "/overrides")
        assert status == 200 and data["overrides"] == []  # nothing stored


@pytest.mark.parametrize(("query", "message"), [
    ("top=1e9", "top must be a whole number of rows from 1 to 1000 (got '1e9')"),
    ("top=0", "top must be a whole number of rows from 1 to 1000 (got '0')"),
    ("top=-3", "top must be a whole number of rows from 1 to 1000 (got '-3')"),
    ("top=" + "9" * 5000, "top must be a whole number of rows from 1 to 1000"),
    ("window=1e999", "window must be a positive number of seconds or a duration like 15m, 1h or 24h (got '1e999')"),
    ("window=nan", "window must be a positive number of seconds or a duration like 15m, 1h or 24h (got 'nan')"),
    ("window=-5", "window must be a positive number of seconds or a duration like 15m, 1h or 24h (got '-5')"),
])
async def test_the_shadow_report_answers_400_with_a_clear_message(tmp_path: Path, query: str, message: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    async with running([policy]) as (server, _):
        status, data = await admin(server, "GET", f"/shadow?{query}")
        assert status == 400 and message in data["error"], data
        assert "invalid literal" not in data["error"] and "base 10" not in data["error"]
        status, _ = await admin(server, "GET", "/shadow?top=5000&window=1h")  # large: capped, not refused
        assert status == 200


async def test_an_override_valid_today_is_reported_not_applied_after_a_policy_edit(tmp_path: Path) -> None:
    # burst 1,000,000 at the policy's rate of 100/s refills in 10,000 s; after an edit to
    # 0.01/s it would take 10^8 s: the override is reported, and the reload still applies.
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    async with running([policy]) as (server, client):
        status, data = await admin(server, "PUT", f"/overrides/user-rate/{HASHED}",
                                   json.dumps({"numbers": {"burst": 1_000_000}}))
        assert status == 200, data
        policy.write_text(POLICY.replace("rate: 100", "rate: 0.01").replace("burst: 1000", "burst: 10"))
        assert server.watcher is not None
        server.watcher.poll_once()
        status, data = await admin(server, "GET", "/status")
        assert data["reload"]["reloads"] == 1 and data["reload"]["failures"] == 0
        (row,) = data["overrides"]["not_applied"]
        assert row["not_applied"] == ("burst (1e+06) / rate (0.01/s): the bucket would take 1e+08 s to refill, "
                                      "more than 30 days (2.592e+06 s): raise the rate or lower the burst")
        assert await client.check(KEY) == 200  # the policy's own numbers serve
        status, _ = await admin(server, "PUT", "/switches/*", "off")
        assert status == 200


# -- the admin-port path of `extauthz override set`, per limiter kind ---------------------


async def test_override_set_through_the_admin_port_for_each_limiter_kind(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    async with running([policy]) as (server, client):
        url = f"http://127.0.0.1:{server.ports.admin_port}"

        async def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(cli, "override", "set", *argv, "--admin", url,
                                           env={"EXTAUTHZ_REDIS_URL": ""})

        # concurrent_requests: limit is an integer, and stays one on the way
        r = await run("user-concurrency", "--identity", KEY, "limit=2")
        assert r.returncode == 0, r.stderr
        assert "user-concurrency limit=2 for identity" in r.stdout and f"applied by the server at {url} now" in r.stdout
        status, data = await admin(server, "GET", "/overrides")
        (row,) = data["overrides"]
        assert row["numbers"] == {"limit": 2} and row["applied"] is True
        assert [await client.check(KEY) for _ in range(3)] == [200, 200, 429]  # 2 in flight, the 3rd refused
        r = await run("user-concurrency", "--identity", KEY, "limit=3.0")  # a whole number written as 3.0
        assert r.returncode == 0, r.stderr
        r = await run("user-concurrency", "--identity", KEY, "limit=2.5")
        assert r.returncode == 1 and "limit: Input should be a valid integer" in r.stderr, r.stderr
        r = await run("user-concurrency", "--identity", KEY, "rate=5")
        assert r.returncode == 1, r.stderr
        assert "rate is not a concurrent_requests field (concurrent_requests: limit)" in r.stderr

        # request_rate: a name of another kind is named as such, with the valid ones
        r = await run("user-rate", "--identity", KEY, "limit=5")
        assert r.returncode == 1, r.stderr
        assert "limit is not a request_rate field (request_rate: rate, burst, cost)" in r.stderr
        assert "valid integer" not in r.stderr
        r = await run("user-rate", "--identity", KEY, "rate=50", "burst=200")
        assert r.returncode == 0, r.stderr
        status, data = await admin(server, "GET", "/overrides")
        assert status == 200
        assert {row["limiter"]: row["numbers"] for row in data["overrides"]} == {
            "user-concurrency": {"limit": 3}, "user-rate": {"rate": 50, "burst": 200}}

        # fleet_usage takes none
        r = await run("fleet", "--identity", KEY, "limit=5")
        assert r.returncode == 1
        assert "limiter 'fleet' limits the whole fleet and takes no per-customer override" in r.stderr
