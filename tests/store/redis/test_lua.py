"""The Lua scripts (lua/, shipped as extauthz.lua): the server clock, each script's contract,
the commands a check costs, the key layouts, and the wheel carrying the scripts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.store.base import BucketOp, FleetGrantOp, LeaseOp
from extauthz.store.redis import SCRIPT_NAMES, load_script
from testinfra.redis_servers import RedisSingle
from tests.conftest import ROOT
from tests.store.conftest import make_redis_store
from tests.store.redis.helpers import BUCKET, USER_LEASES


@pytest.mark.redis
async def test_scripts_read_redis_time_unless_a_clock_is_injected(
    redis_single_clean: RedisSingle, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = redis_single_clean.client()
    store = make_redis_store(redis_single_clean)
    injected = make_redis_store(redis_single_clean, ManualClock(start=5.0))  # 1970
    try:
        await store.ping()

        def redis_now() -> float:
            sec, usec = raw.time()
            return sec + usec / 1e6

        # The process clock is not what the script reads: make it absurd.
        monkeypatch.setattr(time, "time", lambda: 0.0)
        before = redis_now()
        assert (await store.check([BucketOp(BUCKET, 1, 10, 1), LeaseOp(USER_LEASES, 5, 30)], "a")).admitted
        after = redis_now()
        stamp = float(raw.get(BUCKET).split()[1])  # "<tokens> <ts>"
        assert before <= stamp <= after
        expiry = float(raw.zscore(USER_LEASES, "a"))
        assert before + 30 <= expiry <= after + 30
        assert await store.inflight([USER_LEASES]) == [1]

        # An injected clock replaces TIME: its lease (expiring at 35.0, long ago for
        # Redis) is live for the injected clock and swept under Redis TIME.
        assert (await injected.check([LeaseOp(USER_LEASES, 5, 30)], "b")).admitted
        assert float(raw.zscore(USER_LEASES, "b")) == 35.0
        assert await injected.inflight([USER_LEASES]) == [2]
        assert await store.inflight([USER_LEASES]) == [1]
    finally:
        raw.close()
        await store.close()
        await injected.close()


@pytest.mark.slow
def test_wheel_carries_the_lua_scripts_and_envoy_configs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("extauthz", "lua", "envoy"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = out.glob("extauthz-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for script in SCRIPT_NAMES:
            assert f"extauthz/lua/{script}.lua" in names
            assert zf.read(f"extauthz/lua/{script}.lua") == load_script(script).source
        assert "extauthz/lua/__init__.py" in names
        # Packages are listed by hand in pyproject (lua/ is mapped): none may be missed.
        sources = {f"extauthz/{p.relative_to(ROOT / 'extauthz').as_posix()}"
                   for p in (ROOT / "extauthz").rglob("*.py") if "__pycache__" not in p.parts}
        assert sources - names == set()
        # every subpackage is listed in pyproject (packages are listed, not discovered)
        for init in (ROOT / "extauthz").rglob("__init__.py"):
            assert init.relative_to(ROOT).as_posix() in names, init
        assert "extauthz/py.typed" in names
        # The Envoy configs ship once, from the top-level envoy/ (package-dir mapping), as
        # extauthz/envoy/configs/*.yaml: byte-for-byte the repository's files, and no other copy.
        configs = sorted((ROOT / "envoy").glob("*.yaml"))
        assert configs
        for config in configs:
            assert zf.read(f"extauthz/envoy/configs/{config.name}") == config.read_bytes(), config
        assert {n for n in names if n.endswith(".yaml")} == {f"extauthz/envoy/configs/{c.name}" for c in configs}
    # Installed from the wheel (away from the checkout), the tests find the shipped config.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    found = subprocess.run(
        [sys.executable, "-c", "from testinfra.envoy_configs import config_path; print(config_path())"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join((str(site), str(ROOT)))}, check=True,
        capture_output=True, text=True,
        timeout=60,
    ).stdout.strip()
    assert Path(found) == site / "extauthz" / "envoy" / "configs" / "envoy.yaml"


def test_every_script_states_its_contract() -> None:
    for name in SCRIPT_NAMES:
        header = load_script(name).source.decode().split("\n\n")[0]
        assert header.startswith(f"-- {name}.lua:"), name
        for word in ("KEYS", "ARGV", "Returns"):
            assert word in header, (name, word)
        assert "now" in header, name


@pytest.mark.redis
async def test_commands_inside_a_check_are_counted_by_redis(redis_single_clean: RedisSingle) -> None:
    """A token bucket costs GET + SET (one STRING with its TTL), a lease ZREMRANGEBYSCORE +
    ZCARD + ZADD + PEXPIRE, a release ZREM, and the call one TIME (no clock injected) when
    it needs one: Redis's own count."""
    store = make_redis_store(redis_single_clean)
    try:
        await store.ping()
        with redis_single_clean.client() as c:
            c.config_resetstat()
            assert (await store.check([BucketOp(BUCKET, 1, 10, 1), LeaseOp(USER_LEASES, 5, 30)], "a")).admitted
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()}
            assert calls == {"evalsha": 1, "time": 1, "get": 1, "set": 1, "zremrangebyscore": 1,
                             "zcard": 1, "zadd": 1, "pexpire": 1, "config|resetstat": 1}
            assert c.type(BUCKET) == "string" and 0 < c.ttl(BUCKET) <= 20  # ceil(2 * 10 / 1)
            # a release alone: its ZREM, and no TIME (nothing in it needs "now")
            c.config_resetstat()
            assert await store.release([USER_LEASES], "a") == 1
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()}
            assert calls == {"evalsha": 1, "zrem": 1, "config|resetstat": 1}
    finally:
        await store.close()


@pytest.mark.redis
async def test_old_hash_buckets_are_left_to_old_servers(redis_single_clean: RedisSingle) -> None:
    """A rolling upgrade: the previous layout's HASH bucket (``...:rr:<limiter>``) is neither
    read nor written (no WRONGTYPE): old and new servers keep separate buckets meanwhile."""
    old = BUCKET.replace(":rr2:", ":rr:")
    assert old != BUCKET
    store = make_redis_store(redis_single_clean)
    try:
        with redis_single_clean.client() as c:
            c.hset(old, mapping={"t": "0", "ts": "1e18"})  # empty, and refilling far in the future
            c.expire(old, 60)
            assert (await store.check([BucketOp(BUCKET, 1, 2, 1)], "a")).admitted
            assert c.hgetall(old) == {"t": "0", "ts": "1e18"} and c.type(BUCKET) == "string"
    finally:
        await store.close()


@pytest.mark.redis
def test_a_lease_set_emptied_and_refilled_within_one_call_keeps_a_ttl(redis_single_clean: RedisSingle) -> None:
    """check.lua gives a key its TTL once per call; a release that takes the last member
    (and the key, and its TTL) makes the next commit set it again."""
    script = load_script("check")
    lease = (b"l", b"1", b"5", b"30", b"")
    with redis_single_clean.client() as c:
        reply = c.eval(script.source, 1 * 3, USER_LEASES, USER_LEASES, USER_LEASES,
                       "", "a", "1", *lease, "a", "1", b"r", b"0", b"", b"", b"", "b", "1", *lease)
        # a admitted (0 held before), a released (held), b admitted (0 held before)
        assert [int(x) for x in reply[0::3]] == [1, 1, 1] and [int(x) for x in reply[1::3]] == [1, 1, 1]
        assert [float(x) for x in reply[2::3]] == [0.0, 0.0, 0.0]
        assert c.zrange(USER_LEASES, 0, -1) == ["b"]
        assert 29_000 < c.pttl(USER_LEASES) <= 30_000



@pytest.mark.redis
async def test_a_fleet_grant_past_one_slice_is_renewed_and_shrunk_whole(redis_single_clean: RedisSingle) -> None:
    """A grant of 2,500 slots (more than one ``call_sliced`` slice of 500 members, more than
    ``unpack`` takes at once in a single command): grown, renewed and shrunk in a few
    commands, every member with the renewal's expiry."""
    clock = ManualClock(start=100.0)
    store = make_redis_store(redis_single_clean, clock)
    raw = redis_single_clean.client()
    key, ttl = "extauthz:{fleet}:fl:big:other", 30.0
    try:
        have = 0
        for _ in range(3):  # three growths of 1,000 (the schema's largest batch), limit 2,500
            res = await store.check([FleetGrantOp(key, 2500, ttl, "g", have, 1000)], "")
            assert res.admitted
            have = min(2500, have + 1000)
            assert raw.zcard(key) == have
        raw.config_resetstat()
        clock.advance(5.0)
        assert (await store.check([FleetGrantOp(key, 2500, ttl, "g", have, 0)], "")).admitted
        scores = {float(s) for _, s in raw.zrange(key, 0, -1, withscores=True)}
        assert scores == {105.0 + ttl}  # every member renewed
        zadds = int(raw.info("commandstats")["cmdstat_zadd"]["calls"])
        assert zadds == 5  # 2,500 members: 5 slices of 500, not 2,500 commands
        assert (await store.check([FleetGrantOp(key, 2500, ttl, "g", have, -2400)], "")).admitted
        assert sorted(m for m in raw.zrange(key, 0, -1)) == sorted(f"g:{m}" for m in range(100))
    finally:
        raw.close()
        await store.close()
