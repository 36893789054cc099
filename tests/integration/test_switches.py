"""Kill switches: flipped at runtime, without a restart, through the admin port (embedded
store) and through Redis on two replicas at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from extauthz.commands import cli
from extauthz.control.switches import SwitchBoard, Switches, parse_switches, with_switch
from extauthz.core.clock import ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.core.verdict import Mode
from extauthz.server.app import Server
from extauthz.store.memory import MemoryStore
from tests.observe.helpers import Client, admin, eventually, rate, running, write_policy


async def extauthz(*argv: str) -> int:
    """The CLI, in a thread: it does blocking HTTP to servers that run on this loop."""
    return await asyncio.to_thread(cli.main, list(argv))


def test_switch_json_round_trip_and_precedence() -> None:
    s = with_switch(with_switch(Switches(), "user-rate", Mode.OFF), "*", Mode.SHADOW)
    assert parse_switches(json.dumps(s.to_dict())) == s
    assert s.effective("user-rate", Mode.ENFORCE) is Mode.OFF
    assert s.effective("other", Mode.ENFORCE) is Mode.SHADOW
    assert with_switch(s, "*", None).effective("other", Mode.ENFORCE) is Mode.ENFORCE
    for bad in ("[1]", '{"x": "loud"}', "{"):
        with pytest.raises(ValueError):
            parse_switches(bad)


async def test_malformed_stored_switches_keep_the_current_ones() -> None:
    store = MemoryStore()
    applied: list[Switches] = []
    board = SwitchBoard(store, "k", applied.append)
    await store.set_value("k", '{"user-rate": "off"}')
    await board.poll_once()
    await store.set_value("k", "not json")
    assert (await board.poll_once()).to_dict() == {"user-rate": "off"}
    assert board.errors == 1 and len(applied) == 1


async def test_switches_through_the_admin_port_on_the_embedded_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1), rate("other", burst=100)])
    async with running([policy]) as (server, client):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        assert [await client.check("sk_live_a") for _ in range(2)] == [200, 429]

        assert await extauthz("switch", "--admin", url, "user-rate", "shadow") == 0
        assert await client.check("sk_live_a") == 200  # applied at once: would-deny, allowed
        _, status = await admin(server, "GET", "/status")
        assert status["switches"] == {"user-rate": "shadow"}
        assert status["limiters"]["user-rate"]["mode"] == "shadow"
        assert status["limiters"]["user-rate"]["policy_mode"] == "enforce"

        assert await extauthz("switch", "--admin", url, "user-rate", "clear") == 0
        assert await client.check("sk_live_a") == 429

        assert await extauthz("switch", "--admin", url, "*", "off") == 0
        assert await client.check("sk_live_a") == 200
        assert server.engine.snapshot.active == ()  # every limiter off: nothing evaluated

        capsys.readouterr()
        assert await extauthz("switch", "--admin", url, "--list") == 0
        out = capsys.readouterr().out
        assert 'switches: {"*": "off"}' in out
        assert "user-rate" in out and "enforce  -        off" in out

        assert await extauthz("switch", "--admin", url, "*", "clear") == 0
        assert await client.check("sk_live_a") == 429

        # Mistakes are refused, not applied.
        assert await extauthz("switch", "--admin", url, "user-rte", "off") == 1
        err = capsys.readouterr().err
        assert "extauthz switch: error: " in err
        assert "no limiter named 'user-rte' in the policy (did you mean 'user-rate'?)" in err
        code, body = await admin(server, "PUT", "/switches/user-rate", "loud")
        assert code == 400 and "enforce, shadow or off" in body["error"]
        assert server.engine.snapshot.switches == Switches()


@pytest.mark.redis
async def test_kill_switches_flip_two_replicas_sharing_redis(tmp_path: Path, redis_single_clean) -> None:  # type: ignore[no-untyped-def]
    from extauthz.store.redis import RedisStore

    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    url = redis_single_clean.url
    prefix = "kstest"
    servers: list[Server] = []
    clients: list[Client] = []
    cms = [running([policy], store=RedisStore.from_url(url, deadline=0.25), key_prefix=prefix,
                   switch_poll_interval=0.1) for _ in range(2)]
    try:
        for cm in cms:
            server, client = await cm.__aenter__()
            servers.append(server)
            clients.append(client)
        a, b = clients

        # One bucket for the fleet: one request passes on A, then both replicas refuse.
        assert await a.check("sk_live_shared") == 200
        assert await a.check("sk_live_shared") == 429
        assert await b.check("sk_live_shared") == 429

        async def both(status: int) -> bool:
            return [await a.check("sk_live_shared"), await b.check("sk_live_shared")] == [status, status]

        # Through Redis directly (no admin port needed): both replicas follow within ~1 s.
        assert await extauthz("switch", "--redis-url", url, "--key-prefix", prefix, "user-rate", "shadow") == 0
        await eventually(lambda: both(200), within=2.0)
        assert all(s.engine.snapshot.switches.to_dict() == {"user-rate": "shadow"} for s in servers)

        assert await extauthz("switch", "--redis-url", url, "--key-prefix", prefix, "user-rate", "clear") == 0
        await eventually(lambda: both(429), within=2.0)

        # Through replica A's admin port: B sees it through Redis.
        admin_a = f"http://127.0.0.1:{servers[0].ports.admin_port}"
        assert await extauthz("switch", "--admin", admin_a, "*", "off") == 0
        await eventually(lambda: both(200), within=2.0)
        assert servers[1].engine.snapshot.switches.global_mode is Mode.OFF

        assert await extauthz("switch", "--admin", admin_a, "*", "clear") == 0
        await eventually(lambda: both(429), within=2.0)
        assert redis_single_clean.client().get(f"{prefix}:switches") is None
    finally:
        for cm in reversed(cms[:len(servers)]):
            await cm.__aexit__(None, None, None)


def test_the_admin_port_is_never_the_public_check_port(tmp_path: Path) -> None:
    from extauthz.server.app import ServerConfig

    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    with pytest.raises(ValueError, match="must not be the public Check port"):
        Server(ServerConfig(policies=[str(policy)], listen="0.0.0.0:9001", admin_listen="127.0.0.1:9001"))
    server = Server(ServerConfig(policies=[str(policy)], listen="127.0.0.1:9001", admin_listen="off"))
    assert server.ports.admin_listen is None


@pytest.mark.redis
async def test_an_unknown_limiter_is_refused_on_both_paths_with_the_same_message(
        tmp_path: Path, redis_single_clean, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: the admin port refused a switch for a limiter its policy lacks (404) while
    ``extauthz switch --redis-url`` stored any well-formed name. Both now run the one control
    path (extauthz/control/control.py) against the policy: the same refusal, word for word."""
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    url = redis_single_clean.url
    async with running([policy]) as (server, _):
        admin_url = f"http://127.0.0.1:{server.ports.admin_port}"
        assert await extauthz("switch", "--admin", admin_url, "user-rte", "off") == 1
        over_admin = capsys.readouterr().err
        code, body = await admin(server, "PUT", "/switches/user-rte", "off")
        assert code == 404 and body["limiters"] == ["user-rate"]
    assert await extauthz("switch", "user-rte", "off", "--redis-url", url, "--policies", str(policy)) == 1
    over_redis = capsys.readouterr().err
    said = "no limiter named 'user-rte' in the policy (did you mean 'user-rate'?)"
    assert body["error"] == said
    assert over_admin.strip().endswith(f"404 {said}"), over_admin
    assert over_redis.strip() == f"extauthz switch: error: {said}", over_redis
    assert redis_single_clean.client().get("extauthz:switches") is None  # nothing was stored
    assert redis_single_clean.client().xlen("extauthz:history") == 0  # nor recorded

    # a limiter of the policy is taken, and --list shows the policy's limiters and modes
    assert await extauthz("switch", "user-rate", "shadow", "--redis-url", url, "--policies", str(policy)) == 0
    assert await extauthz("switch", "--redis-url", url, "--policies", str(policy), "--list") == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "user-rate" in out and "enforce  shadow   shadow" in out, out


@pytest.mark.redis
async def test_without_a_policy_the_store_path_says_it_cannot_check_names(
        tmp_path: Path, redis_single_clean, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """No --policies: the name is checked for its form only, and stderr says so; the switch is
    stored (every replica ignores a name its policy lacks)."""
    url = redis_single_clean.url
    assert await extauthz("switch", "--redis-url", url, "user-rte", "off") == 0
    out, err = capsys.readouterr()
    assert ("extauthz switch: warning: no --policies: the name 'user-rte' is checked for its form only, "
            "not against the fleet's policy") in err, err
    assert "ok: user-rte -> off on redis" in out
    assert parse_switches(redis_single_clean.client().get("extauthz:switches")).to_dict() == {"user-rte": "off"}
    # a malformed name is still refused, before anything is sent
    assert await extauthz("switch", "--redis-url", url, "user rate", "off") == 1
    assert "extauthz switch: error: bad switch name 'user rate'" in capsys.readouterr().err
    # the global switch names no limiter: nothing to check, no warning
    assert await extauthz("switch", "--redis-url", url, "*", "clear") == 0
    assert "warning" not in capsys.readouterr().err


async def test_the_admin_port_checks_names_against_the_live_policy(tmp_path: Path) -> None:
    """The admin routes' control reads the policy the replica serves now: after a reload that
    renames a limiter, the old name is refused and the new one taken, recorded via the admin port."""
    from extauthz.policy import load_policy

    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    async with running([policy]) as (server, _):
        assert (await admin(server, "PUT", "/switches/user-rate", "shadow"))[0] == 200
        write_policy(policy, [rate("user-rate-v2", burst=1)])
        server.apply_policy(load_policy([policy]))
        code, body = await admin(server, "PUT", "/switches/user-rate", "off")
        assert code == 404 and body == {"error": "no limiter named 'user-rate' in the policy (did you mean "
                                                 "'user-rate-v2'?)", "limiters": ["user-rate-v2"]}
        code, body = await admin(server, "PUT", "/switches/user-rate-v2", "off")
        assert code == 200 and body["limiters"]["user-rate-v2"]["mode"] == "off"
        assert [(c["target"], c["value"], c["via"]) for c in server.panel.status()["changes"]] == [
            ("user-rate", "shadow", "admin"), ("user-rate-v2", "off", "admin")]


@pytest.mark.redis
async def test_a_change_the_store_log_refuses_to_record_is_said_in_the_commands_own_words(
        tmp_path: Path, redis_single_clean, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Review of issue 30: with --redis-url the change lands even when the store's change log
    does not take its record (exit 0), and the command says so in its one form on stderr (it
    was a bare log line, printed only while nothing had configured logging)."""
    url = redis_single_clean.url
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    redis_single_clean.client().set("extauthz:history", "not a stream")  # XADD fails: WRONGTYPE
    assert await extauthz("switch", "user-rate", "off", "--redis-url", url, "--policies", str(policy)) == 0
    out, err = capsys.readouterr()
    assert "ok: user-rate -> off on redis" in out
    (line,) = err.splitlines()
    assert line.startswith("extauthz switch: warning: the change landed, but the store's change log did "
                           "not take its record (switch user-rate set to off: "), line
    assert "WRONGTYPE" in line
    assert parse_switches(redis_single_clean.client().get("extauthz:switches")).to_dict() == {"user-rate": "off"}
    # a change whose record is taken says nothing more
    redis_single_clean.client().delete("extauthz:history")
    assert await extauthz("switch", "user-rate", "clear", "--redis-url", url, "--policies", str(policy)) == 0
    assert capsys.readouterr().err == ""
    assert redis_single_clean.client().xlen("extauthz:history") == 1


class RefusingStore(MemoryStore):
    """The embedded store, except that it can refuse writes of plain values (``writes``) or
    appends to the change log (``log``)."""

    writes = True
    log = True

    async def swap_value(self, key: str, expected: str | None, value: str | None,
                         ttl: float | None = None) -> bool:
        if not self.writes:
            raise StoreUnavailable("down for the test")
        return await super().swap_value(key, expected, value, ttl)

    async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
        if not self.log:
            raise StoreUnavailable("the log is down for the test")
        await super().append_events(key, events, maxlen, ttl)


async def test_the_admin_port_says_400_for_a_bad_name_503_for_the_store_and_200_for_a_lost_record(
        tmp_path: Path) -> None:
    """Review of issue 30: the statuses docs/operations.md promises for a switch change, each
    from the one control path's error kinds (extauthz/server/admin.py ``_failed``)."""
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    store = RefusingStore(ManualClock())
    async with running([policy], store=store) as (server, _):
        code, body = await admin(server, "PUT", "/switches/user%20rate", "off")
        assert (code, body) == (400, {"error": "bad switch name 'user rate'"})
        store.writes = False
        code, body = await admin(server, "PUT", "/switches/user-rate", "off")
        assert code == 503 and body["error"].startswith("the store did not take the change: "), body
        assert "down for the test" in body["error"]
        assert server.engine.snapshot.switches.to_dict() == {} and server.panel.status()["changes"] == []
        store.writes, store.log = True, False  # the change lands; its record in the store does not
        code, body = await admin(server, "PUT", "/switches/user-rate", "off")
        assert code == 200 and body["switches"] == {"user-rate": "off"}
        status = server.panel.status()
        assert status["change_log_errors"] == 1
        assert [(c["target"], c["value"]) for c in status["changes"]] == [("user-rate", "off")]


async def test_a_change_through_the_admin_port_is_in_the_servers_log_with_who_made_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Review of issue 30: the one writer (ChangeLog.record) logs a server's changes
    (``log_changes``), not a command's: the admin port's audit line must not go quiet."""
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    async with running([policy]) as (server, _):
        with caplog.at_level("WARNING", logger="extauthz.changes"):
            code, _ = await admin(server, "PUT", "/switches/user-rate", "shadow",
                                  {"X-Extauthz-Reason": "incident 7", "X-Extauthz-User": "eve"})
    assert code == 200
    (record,) = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "admin_change"]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["target"], fields["value"], fields["via"], fields["reason"]) == (
        "user-rate", "shadow", "admin", "incident 7"), fields


async def test_a_switch_left_by_a_renamed_limiter_can_still_be_cleared(tmp_path: Path) -> None:
    """Review of issue 30: after a reload renames a limiter, its switch stays stored (and would
    apply again if the name came back, a policy rollback); the one control path refused to
    clear it (404, no limiter of that name). A switch that is set can always be cleared; a
    name neither in the policy nor set is still refused."""
    from extauthz.policy import load_policy

    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate", burst=1)])
    async with running([policy]) as (server, _):
        assert (await admin(server, "PUT", "/switches/user-rate", "off"))[0] == 200
        write_policy(policy, [rate("user-rate-v2", burst=1)])
        server.apply_policy(load_policy([policy]))
        code, body = await admin(server, "DELETE", "/switches/user-rte")
        assert code == 404 and body["limiters"] == ["user-rate-v2"], body
        code, body = await admin(server, "PUT", "/switches/user-rate", "shadow")  # setting it: refused
        assert code == 404, body
        code, body = await admin(server, "DELETE", "/switches/user-rate")
        assert code == 200 and body["switches"] == {}, body
        assert server.engine.snapshot.switches.to_dict() == {}
        assert [(c["action"], c["target"]) for c in server.panel.status()["changes"]] == [
            ("set", "user-rate"), ("clear", "user-rate")]


@pytest.mark.redis
async def test_switch_clear_with_policies_clears_a_stale_switch_on_redis(
        tmp_path: Path, redis_single_clean, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    url = redis_single_clean.url
    policy = write_policy(tmp_path / "p.yaml", [rate("user-rate-v2", burst=1)])
    redis_single_clean.client().set("extauthz:switches", json.dumps({"user-rate": "off"}))
    assert await extauthz("switch", "user-rte", "clear", "--redis-url", url, "--policies", str(policy)) == 1
    assert "no limiter named 'user-rte' in the policy" in capsys.readouterr().err
    assert await extauthz("switch", "user-rate", "clear", "--redis-url", url, "--policies", str(policy)) == 0
    assert "ok: cleared user-rate on redis" in capsys.readouterr().out
    assert parse_switches(redis_single_clean.client().get("extauthz:switches")).to_dict() == {}
