"""``extauthz hash`` and ``extauthz inspect`` against a real server (gRPC checks, its admin
port ``GET /customers/<hash>``): the printed hash is the one the server logs, the counters
move as requests are admitted, and the refusals the server made are named."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from extauthz.commands.cli import main
from extauthz.policy.classify import hash_identity
from tests.observe.helpers import SALT, admin, json_logs, rate, running, write_policy

pytestmark = pytest.mark.asyncio
KEY = "sk_live_inspectme"


def policy(tmp_path: Path) -> Path:
    return write_policy(tmp_path / "p" / "api.yaml", [
        rate("user-rate", burst=3),
        {"name": "per-user", "type": "concurrent_requests", "limit": 5},
        {"name": "monthly", "type": "quota", "limit": 100, "period": "month"},
        {"name": "fleet", "type": "fleet_usage", "capacity": 100, "reserved_for_critical": 0.2},
    ])


async def cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
              stdin: str = "") -> tuple[int, str, str]:
    """The command as a user runs it (in a thread: the server under test runs on this loop)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = await asyncio.to_thread(main, args)
    out, err = capsys.readouterr()
    return code, out, err


async def test_hash_and_inspect_through_the_admin_port(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pol = policy(tmp_path)
    code, out, err = await cli(["hash", "-", "--policies", str(pol.parent), "--identity-salt", SALT],
                               capsys, monkeypatch, stdin=KEY + "\n")
    assert code == 0, err
    hashed = out.strip()
    assert KEY not in out + err
    with json_logs() as lines:
        async with running([pol]) as (server, client):
            url = f"http://127.0.0.1:{server.ports.admin_port}"
            status, before = await admin(server, "GET", f"/customers/{hashed}")
            assert status == 200, before
            rows = {r["limiter"]: r for r in before["limiters"]}
            assert rows["user-rate"]["live"]["tokens"] == 3.0
            assert rows["monthly"]["live"] == {"used": 0, "left": 100}
            assert rows["per-user"]["live"]["in_flight"] == 0
            assert rows["fleet"]["per_customer"] is False
            assert before["recent_refusals"]["refusals"] == []

            assert [await client.check(KEY) for _ in range(4)] == [200, 200, 200, 429]
            code, out, err = await cli(["inspect", "-", "--admin", url, "--policies", str(pol.parent),
                                        "--identity-salt", SALT, "--json"], capsys, monkeypatch, stdin=KEY)
            assert code == 0, err
            after: dict[str, Any] = json.loads(out)
            rows = {r["limiter"]: r for r in after["limiters"]}
            assert after["identity"] == hashed
            assert rows["user-rate"]["live"]["tokens"] == pytest.approx(0.0, abs=1e-6)
            assert rows["monthly"]["live"]["used"] == 3  # the refused request took no unit
            refusals = after["recent_refusals"]["refusals"]
            assert [(r["limiter"], r["reason"], r["status"]) for r in refusals] == [
                ("user-rate", "rate_exceeded", 429)]
            assert "this replica only" in after["recent_refusals"]["covers"]

            code, out, err = await cli(["inspect", "--identity-hash", hashed, "--admin", url],
                                       capsys, monkeypatch)
            assert code == 0, err
            assert "user-rate" in out and "3 of 100 used this window" in out
            assert "rate_exceeded" in out
            code, _, err = await cli(["inspect", "--identity-hash", "nothex", "--admin", url], capsys, monkeypatch)
            assert code == 1 and "not an identity hash" in err
    logged = {json.loads(line).get("identity") for line in lines if '"decision"' in line}
    assert hashed in logged  # the hash the command printed is the one the server logs
    assert not any(KEY in line for line in lines)


async def test_report_identities_names_the_hashes_of_the_keys_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`report --identities FILE` shows each hashed identity with the NAME of its line
    (NAME<TAB>KEY; ``line N`` for a key alone), never the key, in text and JSON; a key not in
    the file stays a hash. The key is hashed as `extauthz hash` hashes it (surrounding spaces
    trimmed, as the server trims a header)."""
    pol = write_policy(tmp_path / "p" / "api.yaml", [rate("dark", burst=1, mode="shadow")])
    names = tmp_path / "keys.txt"
    names.write_text("# customers\nAlice Corp\t  sk_live_alice  \nsk_live_bob\n")
    # `extauthz hash` with the same spaced key, with and without --policies: one hash
    hashes = set()
    for extra in (["--policies", str(pol.parent)], []):
        code, out, err = await cli(["hash", "  sk_live_alice  ", "--identity-salt", SALT, *extra], capsys, monkeypatch)
        assert code == 0, err
        hashes.add(out.strip())
    assert hashes == {hash_identity("sk_live_alice", "header:x-api-key", SALT.encode())}
    async with running([pol]) as (server, client):
        for key in ("sk_live_alice", "sk_live_alice", "sk_live_bob", "sk_live_bob"):
            assert await client.check(key) == 200  # shadow: allowed, recorded
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        code, out, err = await cli(["report", "--admin", url, "--identities", str(names), "--policies",
                                    str(pol.parent), "--identity-salt", SALT], capsys, monkeypatch)
        assert code == 0, err
        (alice,) = hashes
        alice_row = next(row for row in out.splitlines() if alice in row)
        assert alice_row.endswith("= Alice Corp") and out.count("= line 3") == 1, out
        assert "sk_live" not in out
        code, out, err = await cli(["report", "--admin", url, "--identities", str(names), "--policies",
                                    str(pol.parent), "--identity-salt", SALT, "--json"], capsys, monkeypatch)
        assert code == 0, err
        labels = sorted(row.get("label") for lim in json.loads(out)["limiters"] for row in lim["top_identities"])
        assert labels == ["Alice Corp", "line 3"] and "sk_live" not in out
        code, _, err = await cli(["report", "--admin", url, "--identities", str(names)], capsys, monkeypatch)
        assert code == 1 and "--identities needs --policies" in err


async def test_inspect_shows_plans_overrides_and_the_grants_this_replica_holds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The numbers that apply: the plan's (``--plan``), a live override's (which wins, and the
    bucket is read with its numbers); with ``consistency: batched`` the tokens this replica
    was granted and has not spent."""
    pol = write_policy(tmp_path / "p" / "api.yaml", [
        {**rate("user-rate", burst=4), "plans": {"pro": {"burst": 8}}},
        {**rate("batched", burst=100, rate_per_s=1.0), "consistency": "batched", "batch": 10},
    ], plan={"from": [{"header": "x-plan"}], "default": "free"})
    hashed = hash_identity(KEY, "header:x-api-key", SALT.encode())
    async with running([pol]) as (server, client):
        url = f"http://127.0.0.1:{server.ports.admin_port}"
        assert await client.check(KEY, headers={"x-plan": "pro"}) == 200

        async def view(*extra: str) -> dict[str, Any]:
            code, out, err = await cli(["inspect", "--identity-hash", hashed, "--admin", url, "--json", *extra],
                                       capsys, monkeypatch)
            assert code == 0, err
            return {r["limiter"]: r for r in json.loads(out)["limiters"]}

        free, pro = await view(), await view("--plan", "pro")
        assert (free["user-rate"]["numbers_from"], free["user-rate"]["numbers"]["burst"]) == ("limiter", 4.0)
        assert (pro["user-rate"]["numbers_from"], pro["user-rate"]["numbers"]["burst"]) == ("plan pro", 8.0)
        assert pro["user-rate"]["live"]["tokens"] == pytest.approx(7.0)  # the pro bucket took one
        assert pro["batched"]["live"]["tokens"] == pytest.approx(90.0)  # a grant of 10 left the store...
        assert pro["batched"]["live"]["held_by_this_replica"] == pytest.approx(9.0)  # ...1 spent here

        status, _ = await admin(server, "PUT", f"/overrides/user-rate/{hashed}", json.dumps(
            {"numbers": {"rate": 1, "burst": 20}, "ttl": 3600, "reason": "launch", "source": "header:x-api-key"}))
        assert status == 200
        over = (await view("--plan", "pro"))["user-rate"]
        assert over["numbers_from"] == "override" and over["numbers"]["burst"] == 20.0
        assert over["override"]["reason"] == "launch"
        code, _, err = await cli(["inspect", "--identity-hash", hashed, "--admin", url, "--plan", "gold"],
                                 capsys, monkeypatch)
        assert code == 1 and "the policy has no plan 'gold'" in err
