"""The admin port's lock, through a running server's real admin port: only loopback or
configured Host values, changes only with a header a browser cannot send cross-origin, the
bearer token (rotated file, constant metrics port), the refusal to start exposed without a
token, and the change log (reason, who) in the log, /status and ``extauthz history``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from extauthz.control.changelog import HISTORY_MAXLEN, HISTORY_TTL, Change, append_change, read_history
from extauthz.devtools.stack import ServerProcess, free_port
from testinfra.redis_servers import RedisSingle
from tests.observe.helpers import admin, http, running

from ..conftest import ROOT

TOKEN_A = "alice-token-0123456789abcdef"
TOKEN_B = "ci-token-fedcba9876543210"


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EXTAUTHZ_")}
    return subprocess.run([sys.executable, "-m", "extauthz", *argv], capture_output=True, text=True,
                          timeout=60, check=False, env={**base, **(env or {})})


async def test_a_foreign_host_cannot_change_a_switch_and_a_change_needs_the_client_header() -> None:
    async with running([ROOT / "policies"]) as (server, _):
        base = f"http://127.0.0.1:{server.ports.admin_port}"
        # DNS rebinding: a page on attacker.example resolved to 127.0.0.1 sends its own Host
        status, body = await http("PUT", f"{base}/switches/*", "off",
                                  {"Host": "attacker.example", "X-Extauthz-Client": "x"})
        assert status == 403, body
        assert "Host 'attacker.example' is not allowed on the admin port" in json.loads(body)["error"]
        status, _ = await http("GET", f"{base}/status", headers={"Host": f"attacker.example:{server.ports.admin_port}"})
        assert status == 403
        assert server.engine.snapshot.switches.to_dict() == {}
        # a cross-origin form post (no custom header) changes nothing either
        status, body = await http("PUT", f"{base}/switches/*", "off", {"Host": "localhost"})
        assert status == 403 and "X-Extauthz-Client" in json.loads(body)["error"]
        status, body = await http("DELETE", f"{base}/switches/user-rate")
        assert status == 403
        assert server.engine.snapshot.switches.to_dict() == {}
        # loopback names (any port) with the header do
        for host in ("localhost:9", f"127.0.0.1:{server.ports.admin_port}", "[::1]:9002"):
            status, _ = await http("GET", f"{base}/switches", headers={"Host": host})
            assert status == 200, host
        status, data = await admin(server, "PUT", "/switches/*", "off", {"Host": "localhost"})
        assert status == 200 and data["switches"] == {"*": "off"}
        assert server.panel.status()["admin"]["refused"] == {"client_header": 2, "host": 2}


async def test_a_reason_given_in_an_override_body_is_the_change_logs_reason() -> None:
    # Without a token the reason may come in the JSON body (the documented admin API): the
    # override row kept it, the change log recorded "(no reason)".
    async with running([ROOT / "policies"]) as (server, _):
        status, _ = await admin(server, "PUT", "/overrides/user-rate/" + "ab" * 12,
                                json.dumps({"numbers": {"rate": 50}, "reason": "launch day"}))
        assert status == 200
        row = (await server.control.overrides())["overrides"][0]
        assert row["reason"] == "launch day"
        assert server.panel.status()["changes"][-1]["reason"] == "launch day"


async def test_configured_admin_hosts_are_answered() -> None:
    async with running([ROOT / "policies"], admin_hosts=("extauthz-admin.internal",)) as (server, _):
        base = f"http://127.0.0.1:{server.ports.admin_port}"
        status, _ = await http("GET", f"{base}/status", headers={"Host": "EXTAUTHZ-admin.internal:9002"})
        assert status == 200
        status, _ = await http("GET", f"{base}/status", headers={"Host": "other.internal"})
        assert status == 403


async def test_with_a_token_every_admin_request_needs_it_and_a_change_a_reason(tmp_path: Path) -> None:
    tokens = tmp_path / "admin-tokens"
    tokens.write_text(f"# operators\nalice:{TOKEN_A}\n\nci:{TOKEN_B}\n")
    async with running([ROOT / "policies"], admin_token_file=str(tokens)) as (server, _):
        base = f"http://127.0.0.1:{server.ports.admin_port}"
        for path in ("/status", "/switches", "/overrides", "/history", "/shadow"):
            status, _ = await http("GET", base + path)
            assert status == 401, path
        status, _ = await http("GET", f"{base}/status", headers={"Authorization": f"Bearer {TOKEN_A}x"})
        assert status == 401
        status, _ = await http("GET", f"{base}/status", headers={"Authorization": TOKEN_A})
        assert status == 401
        status, body = await http("GET", f"{base}/healthz")  # health needs none
        assert status == 200 and json.loads(body) == {"ok": True}
        status, _ = await http("GET", f"http://127.0.0.1:{server.ports.metrics_port}/metrics")
        assert status == 200  # the metrics port stays open

        alice = {"Authorization": f"Bearer {TOKEN_A}"}
        status, body = await http("PUT", f"{base}/switches/user-rate", "shadow", alice)
        assert status == 400 and "reason" in json.loads(body)["error"]
        assert server.engine.snapshot.switches.to_dict() == {}
        status, _ = await http("PUT", f"{base}/switches/user-rate", "shadow",
                               {**alice, "X-Extauthz-Reason": "incident%2042%20%E2%80%94%20rollback",
                                "X-Extauthz-User": "alice.k"})
        assert status == 200
        assert server.engine.snapshot.switches.to_dict() == {"user-rate": "shadow"}
        status, body = await http("GET", f"{base}/history", headers={"Authorization": f"Bearer {TOKEN_B}"})
        (change,) = json.loads(body)["changes"]
        assert (change["kind"], change["action"], change["target"], change["value"]) == (
            "switch", "set", "user-rate", "shadow")
        assert change["reason"] == "incident 42 \u2014 rollback"
        assert change["by"] == "alice" and change["user"] == "alice.k" and change["via"] == "admin"
        assert server.panel.status()["changes"] == [change]

        # a rotated file is read again at the next request: the old token is refused
        tokens.write_text(f"ci:{TOKEN_B}\n")
        status, _ = await http("GET", f"{base}/status", headers=alice)
        assert status == 401
        status, _ = await http("GET", f"{base}/status", headers={"Authorization": f"Bearer {TOKEN_B}"})
        assert status == 200
        # a rewrite without a valid token keeps the previous tokens (never opens the port)
        tokens.write_text("short\n")
        status, _ = await http("GET", f"{base}/status")
        assert status == 401
        status, data = await admin(server, "GET", "/status", headers={"Authorization": f"Bearer {TOKEN_B}"})
        assert status == 200 and data["admin"]["token_errors"] >= 1


async def test_every_admin_command_takes_the_token_file_and_its_variable(tmp_path: Path) -> None:
    tokens = tmp_path / "admin-tokens"
    tokens.write_text(f"alice:{TOKEN_A}\n")
    mine = tmp_path / "my-token"
    mine.write_text(TOKEN_A + "\n")
    async with running([ROOT / "policies"], admin_token_file=str(tokens)) as (server, _):
        url = f"http://127.0.0.1:{server.ports.admin_port}"

        def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            return cli(*argv, "--admin", url, env=env)

        without = await asyncio.to_thread(run, "status")
        assert without.returncode == 1 and "401" in without.stderr and "--admin-token-file" in without.stderr
        for argv in (("status",), ("switch", "--list"), ("report",), ("history",), ("override", "list")):
            r = await asyncio.to_thread(run, *argv, "--admin-token-file", str(mine))
            assert r.returncode == 0, (argv, r.stderr)
            assert f"extauthz: admin port {url}" in r.stderr  # which server it talked to
            r = await asyncio.to_thread(run, *argv, env={"EXTAUTHZ_ADMIN_TOKEN_FILE": str(mine)})
            assert r.returncode == 0, (argv, r.stderr)

        env = {"EXTAUTHZ_ADMIN_TOKEN_FILE": str(mine)}
        r = await asyncio.to_thread(run, "switch", "*", "shadow", env=env)
        assert r.returncode == 1 and "--reason is required" in r.stderr
        r = await asyncio.to_thread(run, "switch", "*", "shadow", "--reason", "load test", env=env)
        assert r.returncode == 0, r.stderr
        assert f"ok: * -> shadow on {url}" in r.stdout
        r = await asyncio.to_thread(run, "override", "set", "user-rate", "--identity", "sk_live_vip",
                                    "rate=50", "--reason", "launch", "--by", "bob", env=env)
        assert r.returncode == 0, r.stderr
        assert f"applied by the server at {url} now" in r.stdout
        r = await asyncio.to_thread(run, "override", "clear", "user-rate", "--identity", "sk_live_vip",
                                    "--reason", "launch over", env=env)
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(run, "history", env=env)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].split()[:3] == ["when", "(UTC)", "kind"] and len(lines) == 4
        assert "switch" in lines[1] and "load test" in lines[1] and "alice" in lines[1]
        assert "override" in lines[2] and "rate=50" in lines[2] and "alice (bob)" in lines[2]
        assert "clear" in lines[3] and "launch over" in lines[3]
        data = json.loads((await asyncio.to_thread(run, "history", "--json", "--last", "1", env=env)).stdout)
        assert [c["reason"] for c in data["changes"]] == ["launch over"]
        status, rows = await admin(server, "GET", "/overrides", headers={"Authorization": f"Bearer {TOKEN_A}"})
        assert status == 200 and rows["overrides"] == []


def test_the_server_refuses_an_exposed_admin_port_without_a_token(tmp_path: Path) -> None:
    r = cli("serve", "--policies", str(ROOT / "policies"), "--listen", f"127.0.0.1:{free_port()}",
            "--admin-listen", "0.0.0.0:0")
    assert r.returncode == 2
    assert "not a loopback address, without a token" in r.stderr and "--admin-token-file" in r.stderr
    r = cli("serve", "--policies", str(ROOT / "policies"), "--listen", f"127.0.0.1:{free_port()}",
            env={"EXTAUTHZ_ADMIN_LISTEN": "[::]:0"})
    assert r.returncode == 2 and "--admin-token-file (EXTAUTHZ_ADMIN_TOKEN_FILE)" in r.stderr
    weak = tmp_path / "weak"
    weak.write_text("secret\n")
    r = cli("serve", "--policies", str(ROOT / "policies"), "--listen", f"127.0.0.1:{free_port()}",
            "--admin-token-file", str(weak))
    assert r.returncode == 2 and f"{weak}:1: a token has at least 16 characters" in r.stderr
    r = cli("serve", "--policies", str(ROOT / "policies"), "--listen", f"127.0.0.1:{free_port()}",
            "--admin-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read the admin token file" in r.stderr


@pytest.mark.parametrize("header", ["attacker.example", "127.0.0.1.attacker.example", "localhost.evil",
                                    "[::1", "127.0.0.1:80:80", ""])
async def test_host_values_that_are_not_loopback_are_refused(header: str) -> None:
    async with running([ROOT / "policies"]) as (server, _):
        status, _ = await admin(server, "GET", "/switches", headers={"Host": header})
        assert status == 403, header


@pytest.mark.redis
@pytest.mark.slow
def test_history_shows_a_change_made_on_one_replica_from_another(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    tokens = tmp_path / "admin-tokens"
    tokens.write_text(f"alice:{TOKEN_A}\n")
    env = {"EXTAUTHZ_REDIS_URL": redis_single_clean.url, "EXTAUTHZ_ADMIN_TOKEN_FILE": str(tokens)}
    procs = [ServerProcess([ROOT / "policies"], env=env, workdir=tmp_path) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        one, two = (f"http://127.0.0.1:{p.admin_port}" for p in procs)
        r = cli("switch", "user-rate", "off", "--reason", "incident 7", "--admin", one, env=env)
        assert r.returncode == 0, r.stderr
        r = cli("history", "--json", "--admin", two, env=env)  # the other replica
        assert r.returncode == 0, r.stderr
        assert f"extauthz: admin port {two}" in r.stderr
        (change,) = json.loads(r.stdout)["changes"]
        assert (change["target"], change["value"], change["reason"], change["by"]) == (
            "user-rate", "off", "incident 7", "alice")
        # a change straight on Redis goes to the same log; history reads it from Redis too
        r = cli("switch", "user-rate", "clear", "--reason", "over", "--by", "bob",
                "--redis-url", redis_single_clean.url, env=env)
        assert r.returncode == 0, r.stderr
        for argv in (("--admin", two), ("--redis-url", redis_single_clean.url)):
            r = cli("history", *argv, env=env)
            assert r.returncode == 0, r.stderr
            rows = r.stdout.splitlines()[1:]
            assert len(rows) == 2 and "incident 7" in rows[0] and "alice" in rows[0]
            assert "clear" in rows[1] and "bob" in rows[1] and "(redis)" in rows[1]
        assert [line for line in procs[0].log().splitlines() if "switch user-rate set to off by alice" in line]
    finally:
        for p in procs:
            p.stop()
    with redis_single_clean.client() as raw:  # bounded: a TTL (and MAXLEN on every append)
        assert 0 < raw.pttl("extauthz:history") <= HISTORY_TTL * 1000


@pytest.mark.redis
async def test_the_change_log_in_redis_is_bounded(redis_single_clean: RedisSingle) -> None:
    from extauthz.store.redis import RedisStore

    store = RedisStore.from_url(redis_single_clean.url, deadline=1.0)
    try:
        for i in range(HISTORY_MAXLEN + 300):
            await append_change(store, "extauthz:history", Change(kind="switch", action="set",
                                                                  target="*", value=str(i), at=float(i)))
        changes = await read_history(store, "extauthz:history")
    finally:
        await store.close()
    assert HISTORY_MAXLEN <= len(changes) < HISTORY_MAXLEN + 300  # MAXLEN ~ trims whole nodes
    assert changes[-1].value == str(HISTORY_MAXLEN + 299)


@pytest.mark.redis
async def test_a_malformed_event_in_the_change_log_is_skipped(redis_single_clean: RedisSingle) -> None:
    # Anyone who can write Redis can put an event in the log; one nested too deeply for the
    # JSON parser raised RecursionError out of `extauthz history` and GET /history (500).
    from extauthz.store.redis import RedisStore

    store = RedisStore.from_url(redis_single_clean.url, deadline=1.0)
    try:
        await store.append_events("extauthz:history", ["[" * 100_000, "{not json", "[1]"],
                                  HISTORY_MAXLEN, HISTORY_TTL)
        await append_change(store, "extauthz:history", Change(kind="switch", action="set",
                                                              target="*", value="off", at=1.0))
        changes = await read_history(store, "extauthz:history")
    finally:
        await store.close()
    assert [(c.target, c.value) for c in changes] == [("*", "off")]


async def test_control_characters_are_refused_at_the_admin_port_and_a_stored_one_printed_escaped() -> None:
    # Issue 29: control characters in reasons and user names were stored and printed raw: an
    # escape sequence reached the operator's terminal, a CR/LF forged a line of the history.
    async with running([ROOT / "policies"]) as (server, _):
        for headers, what in (({"X-Extauthz-Reason": "incident%0D%0A2026-01-01T00:00:00Z%20forged"},
                               "the reason (X-Extauthz-Reason) holds a control character (\\r at position 9)"),
                              ({"X-Extauthz-User": "%1B%5B31mroot"},
                               "the user (X-Extauthz-User) holds a control character (\\x1b at position 1)")):
            status, data = await admin(server, "PUT", "/switches/user-rate", "shadow", headers)
            assert status == 400 and what in data["error"], data
        status, data = await admin(server, "PUT", "/overrides/user-rate/" + "ab" * 12,
                                   json.dumps({"numbers": {"rate": 50}, "reason": "launch\u2028day"}))
        assert status == 400 and "the reason holds a control character (\\u2028" in data["error"], data
        assert server.engine.snapshot.switches.to_dict() == {}
        assert (await server.control.overrides())["overrides"] == []
        assert server.panel.status()["admin"]["refused"] == {"control_character": 2}
        assert server.panel.status()["changes"] == []

        # a record an older version stored: `extauthz history` prints it escaped, on one line
        await append_change(server.fleet.changes.store, server.fleet.changes.key, Change(
            kind="switch", action="set", target="*", value="off", at=1.0, via="admin",
            reason="x\r\n1970-01-01T00:00:00Z     switch   set    *", user="\x1b]0;pwned\x07eve"))
        r = await asyncio.to_thread(cli, "history", "--admin", f"http://127.0.0.1:{server.ports.admin_port}")
        assert r.returncode == 0, r.stderr
        assert len(r.stdout.splitlines()) == 2 and "\x1b" not in r.stdout and "\r" not in r.stdout
        assert "x\\r\\n1970-01-01T00:00:00Z" in r.stdout and "\\x1b]0;pwned\\x07eve" in r.stdout


async def test_a_bad_token_file_keeps_the_last_good_tokens_loudly_and_a_deleted_one_revokes_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 29: a rotation with one malformed line showed only `token_errors: 1` (and logged
    # at every request); deleting the file revoked nothing.
    token_c = "dave-token-00112233445566778899"
    tokens = tmp_path / "admin-tokens"
    tokens.write_text(f"alice:{TOKEN_A}\nci:{TOKEN_B}\n")
    alice, ci, dave = ({"Authorization": f"Bearer {t}"} for t in (TOKEN_A, TOKEN_B, token_c))
    async with running([ROOT / "policies"], admin_token_file=str(tokens)) as (server, _):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        status, data = await admin(server, "GET", "/status", headers=ci)
        assert status == 200
        assert data["admin"]["token_file"] == {"path": str(tokens), "ok": True, "tokens": 2,
                                               "error": None, "since": None}
        caplog.clear()
        tokens.write_text(f"ci:{TOKEN_B}\nbob:short\ndave:{token_c}\n")  # alice out, dave in: line 2 bad
        for _ in range(3):
            status, data = await admin(server, "GET", "/status", headers=ci)
            assert status == 200
        assert (await admin(server, "GET", "/status", headers=alice))[0] == 200  # the last good set
        assert (await admin(server, "GET", "/status", headers=dave))[0] == 401
        state = data["admin"]["token_file"]
        assert state["ok"] is False and state["tokens"] == 2 and isinstance(state["since"], float)
        assert state["error"].startswith(f"{tokens}:2: a token has at least 16 characters")
        assert state["error"].endswith("keeping the 2 tokens read before")
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "admin tokens not read" in r.getMessage()]
        assert len(errors) == 1, errors  # once for that version of the file, not per request
        mine = tmp_path / "my-token"
        mine.write_text(TOKEN_B + "\n")
        r = await asyncio.to_thread(cli, "status", "--admin", url, env={"EXTAUTHZ_ADMIN_TOKEN_FILE": str(mine)})
        assert r.returncode == 0 and "admin token file NOT read again since" in r.stdout, r.stdout + r.stderr

        tokens.write_text(f"ci:{TOKEN_B}\ndave:{token_c}\n")  # fixed: read as a whole
        status, data = await admin(server, "GET", "/status", headers=dave)
        assert status == 200 and data["admin"]["token_file"]["ok"] is True
        assert (await admin(server, "GET", "/status", headers=alice))[0] == 401

        tokens.unlink()  # deleted: every token revoked, changes and reads alike
        for headers in (ci, dave):
            status, _ = await admin(server, "PUT", "/switches/*", "off", {**headers, "X-Extauthz-Reason": "x"})
            assert status == 401
            assert (await admin(server, "GET", "/status", headers=headers))[0] == 401
        assert server.engine.snapshot.switches.to_dict() == {}
        assert (await http("GET", f"{url}/healthz"))[0] == 200
        assert (await http("GET", f"http://127.0.0.1:{server.ports.metrics_port}/metrics"))[0] == 200
        assert [r for r in caplog.records if r.levelname == "ERROR" and "is gone" in r.getMessage()]

        tokens.write_text(f"ci:{TOKEN_B}\n")  # back
        status, data = await admin(server, "GET", "/status", headers=ci)
        assert status == 200 and data["admin"]["token_file"]["ok"] is True
