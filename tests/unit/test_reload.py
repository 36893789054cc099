"""Hot reload on a real temporary directory: good edits take effect, broken edits keep the
last good policy serving and are reported once, ConfigMap symlink swaps are picked up."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.reload_lag import big_policy, reload_lag
from extauthz.core.clock import ManualClock
from extauthz.engine import reload as reload_module
from extauthz.engine.reload import PolicyWatcher
from extauthz.policy import load_policy
from extauthz.policy.loader import MAX_FILE_BYTES
from tests.observe.helpers import admin, eventually, rate, running, write_policy
from tests.unit.helpers import engine_for, get


async def allowed_in_a_row(engine, key: str = "sk_live_alice", limit: int = 50) -> int:  # type: ignore[no-untyped-def]
    n = 0
    while n < limit:
        _, decision = await engine.check(get(key=key))
        if not decision.allowed:
            return n
        n += 1
    return n


def watcher_for(directory: Path, clock: ManualClock):  # type: ignore[no-untyped-def]
    policy = load_policy([directory])
    engine, _ = engine_for(policy, clock)
    return engine, PolicyWatcher([directory], engine.set_policy, current=policy, clock=clock)


async def test_a_good_edit_takes_effect(tmp_path: Path, clock: ManualClock) -> None:
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=2)])
    engine, watcher = watcher_for(tmp_path / "p", clock)
    old = engine.snapshot.policy.version
    assert await allowed_in_a_row(engine, "sk_live_a") == 2
    assert watcher.poll_once() is False  # nothing changed

    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=5)])
    assert watcher.poll_once() is True
    assert watcher.version == engine.snapshot.policy.version != old
    assert await allowed_in_a_row(engine, "sk_live_b") == 5
    assert watcher.reloads == 1 and watcher.failures == 0 and watcher.last_error is None


async def test_a_new_file_in_the_directory_is_picked_up(tmp_path: Path, clock: ManualClock) -> None:
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=2)])
    engine, watcher = watcher_for(tmp_path / "p", clock)
    (tmp_path / "p" / "more.yaml").write_text(
        "version: 1\nlimiters:\n  - {name: extra, type: request_rate, rate: 1, burst: 1, mode: shadow}\n")
    assert watcher.poll_once() is True
    assert [s.name for s in engine.snapshot.policy.limiters] == ["user-rate", "extra"]


async def test_a_broken_edit_keeps_the_old_policy_and_is_reported_once(
        tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    f = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=2)])
    engine, watcher = watcher_for(tmp_path / "p", clock)
    good = engine.snapshot.policy.version

    f.write_text(f.read_text().replace("burst: 2", "burst: -3\n  bogus_field: 1"))
    with caplog.at_level(logging.ERROR, logger="extauthz.reload"):
        assert watcher.poll_once() is False
        assert watcher.poll_once() is False  # same broken content: not logged or counted again
        clock.advance(5)
        assert watcher.poll_once() is False
    assert engine.snapshot.policy.version == good  # the last good policy keeps serving
    assert await allowed_in_a_row(engine) == 2
    assert watcher.failures == 1
    records = [r for r in caplog.records if r.name == "extauthz.reload"]
    assert len(records) == 1
    err = watcher.status()["last_error"]
    assert isinstance(err, dict)
    issues = err["issues"]
    line = f.read_text().splitlines().index("  burst: -3") + 1
    assert any(i.startswith(f"{f}:{line}: limiters[0].burst:") for i in issues), issues
    assert any("limiters[0].bogus_field" in i and "unknown field" in i for i in issues), issues
    assert records[0].fields["issues"] == issues  # type: ignore[attr-defined]

    # Another distinct broken content is a new failure; fixing it clears the error.
    f.write_text("version: 1\nlimiters: [\n")
    assert watcher.poll_once() is False and watcher.failures == 2
    write_policy(f, [rate("user-rate", burst=4)])
    assert watcher.poll_once() is True
    assert watcher.last_error is None and watcher.failures == 2
    assert await allowed_in_a_row(engine, "sk_live_new") == 4


def configmap(directory: Path, stamp: str, files: dict[str, str]) -> None:
    """What the kubelet does: write a timestamped dir, point ``..data`` at it atomically,
    keep the visible names as symlinks into ``..data/``, drop the old dir."""
    directory.mkdir(exist_ok=True)
    new = directory / f"..{stamp}"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    tmp = directory / "..data_tmp"
    tmp.symlink_to(new.name)
    os.replace(tmp, directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    if old is not None:
        for child in (directory / old).iterdir():
            child.unlink()
        (directory / old).rmdir()


async def test_a_policy_whose_swap_fails_is_counted_shown_and_retried(
        tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A valid policy whose new snapshot cannot be built (it was an override that made the
    # build raise) was dropped silently: the digest was marked seen, nothing was counted.
    f = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=2)])
    engine, watcher = watcher_for(tmp_path / "p", clock)
    good = engine.snapshot.policy.version
    # The retries reuse the built policy: parsing the same (up to 1 MiB) content on every
    # poll kept a worker thread busy (and the GIL taken) for as long as the swap failed.
    parses = 0

    def counting_load(paths, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal parses
        parses += 1
        return load_policy(paths, **kwargs)

    monkeypatch.setattr(reload_module, "load_policy", counting_load)
    calls = 0

    def flaky(policy):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise OverflowError("cannot convert float infinity to integer")
        engine.set_policy(policy)

    watcher.apply = flaky
    write_policy(f, [rate("user-rate", burst=5)])
    with caplog.at_level(logging.ERROR, logger="extauthz.reload"):
        assert watcher.poll_once() is False
        assert watcher.poll_once() is False  # retried, not counted or logged again
    assert engine.snapshot.policy.version == good and watcher.version == good
    assert watcher.failures == 1 and watcher.reloads == 0
    assert watcher.status()["last_error"]["issues"] == [  # type: ignore[index]
        "applying the policy failed: OverflowError: cannot convert float infinity to integer"]
    assert len([r for r in caplog.records if r.name == "extauthz.reload"]) == 1
    assert watcher.poll_once() is True  # the third try applies
    assert parses == 1  # parsed once, tried three times
    assert watcher.reloads == 1 and watcher.last_error is None
    assert engine.snapshot.policy.version != good and await allowed_in_a_row(engine) == 5
    write_policy(f, [rate("user-rate", burst=6)])  # new content is parsed, of course
    assert watcher.poll_once() is True and parses == 2


async def test_a_configmap_symlink_swap_is_picked_up(tmp_path: Path, clock: ManualClock) -> None:
    source = tmp_path / "src.yaml"
    write_policy(source, [rate("user-rate", burst=2)])
    cm = tmp_path / "cm"
    configmap(cm, "2026_01_01_00_00_00.1", {"api.yaml": source.read_text()})
    assert (cm / "api.yaml").is_symlink() and (cm / "..data").is_symlink()
    engine, watcher = watcher_for(cm, clock)
    assert engine.snapshot.policy.sources == (str(cm / "api.yaml"),)  # read once, via the visible link

    write_policy(source, [rate("user-rate", burst=3)])
    configmap(cm, "2026_01_01_00_01_00.2", {"api.yaml": source.read_text()})
    assert watcher.poll_once() is True
    assert await allowed_in_a_row(engine) == 3
    assert not (cm / "..2026_01_01_00_00_00.1").exists()


async def test_the_server_reloads_in_the_background_and_status_shows_errors(tmp_path: Path) -> None:
    f = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    async with running([tmp_path / "p"], reload_interval=0.05) as (server, client):
        _, status = await admin(server, "GET", "/status")
        first = status["policy"]["version"]
        assert status["reload"]["last_error"] is None
        assert [await client.check("sk_live_x") for _ in range(2)] == [200, 429]

        f.write_text("version: 1\nlimiters:\n  - {name: user-rate, type: request_rate, rate: nope}\n")

        async def broken() -> bool:
            _, s = await admin(server, "GET", "/status")
            return s["reload"]["last_error"] is not None

        await eventually(broken)
        _, status = await admin(server, "GET", "/status")
        assert status["policy"]["version"] == first
        assert status["reload"]["failures"] == 1
        assert any("limiters[0].rate" in i for i in status["reload"]["last_error"]["issues"])
        assert await client.check("sk_live_x") == 429  # still the old policy

        write_policy(f, [rate("user-rate", burst=1, mode="shadow")])

        async def reloaded() -> bool:
            _, s = await admin(server, "GET", "/status")
            return s["policy"]["version"] != first and s["reload"]["last_error"] is None

        await eventually(reloaded)
        assert await client.check("sk_live_x") == 200  # shadow now: would-deny, allowed


async def test_several_teams_configmaps_projected_into_one_directory(tmp_path: Path, clock: ManualClock) -> None:
    """The chart's ``policies.configMaps``: a projected volume writes every ConfigMap's files into
    one ``..data`` directory with the same atomic swap. Each team's edit takes effect; a limiter
    name or an ``identity`` that another team's file already defines fails, naming both files,
    while the last good policy keeps serving."""
    platform = "version: 1\nidentity: [{header: x-api-key}]\n"

    def team(name: str, burst: int, extra: str = "") -> str:
        return (f"version: 1\n{extra}limiters:\n"
                f"  - {{name: {name}, type: request_rate, rate: 0.001, burst: {burst}}}\n")

    cm = tmp_path / "policies"
    files = {"api.yaml": platform, "team-a.yaml": team("team-a-rate", 5), "team-b.yaml": team("team-b-rate", 3)}
    configmap(cm, "2026_01_01_00_00_00.1", files)
    engine, watcher = watcher_for(cm, clock)
    assert [s.name for s in engine.snapshot.policy.limiters] == ["team-a-rate", "team-b-rate"]
    assert await allowed_in_a_row(engine, "sk_live_a") == 3

    files["team-b.yaml"] = team("team-b-rate", 4)  # team B edits its own ConfigMap
    configmap(cm, "2026_01_01_00_01_00.2", files)
    assert watcher.poll_once() is True
    assert await allowed_in_a_row(engine, "sk_live_b") == 4
    good = engine.snapshot.policy.version

    for stamp, bad, expected in [
        ("2026_01_01_00_02_00.3", team("team-a-rate", 9),
         f"{cm}/team-b.yaml:3: limiters[0].name: duplicate limiter name 'team-a-rate' (first in {cm}/team-a.yaml:3)"),
        ("2026_01_01_00_03_00.4", team("team-b-rate", 4, "identity: [{source_ip: true}]\n"),
         f"{cm}/team-b.yaml:2: identity: 'identity' is already set in {cm}/api.yaml; it may appear in one file only"),
    ]:
        configmap(cm, stamp, {**files, "team-b.yaml": bad})
        assert watcher.poll_once() is False
        err = watcher.status()["last_error"]
        assert isinstance(err, dict) and expected in err["issues"], err
        assert engine.snapshot.policy.version == good
    configmap(cm, "2026_01_01_00_04_00.5", files)  # team B reverts: the policy being served
    assert watcher.poll_once() is False and watcher.last_error is None
    assert engine.snapshot.policy.version == good


async def test_checks_are_answered_while_a_new_policy_is_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload job parses off the event loop: a parse that does not end until the test
    says so must not hold a Check (it held them for seconds when it ran on the loop)."""
    f = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    parsing, proceed, parsed = threading.Event(), threading.Event(), threading.Event()

    def slow_load(paths, **kwargs):  # type: ignore[no-untyped-def]
        parsing.set()
        proceed.wait(timeout=5)  # only an escape: on the event loop this would wait forever
        parsed.set()
        return load_policy(paths, **kwargs)

    monkeypatch.setattr(reload_module, "load_policy", slow_load)
    async with running([tmp_path / "p"], reload_interval=0.05) as (server, client):
        first = server.engine.snapshot.policy.version
        write_policy(f, [rate("user-rate", burst=1, mode="shadow")])
        await eventually(parsing.is_set)
        answers = [await client.check("sk_live_x") for _ in range(2)]
        answered_while_parsing = not parsed.is_set()
        proceed.set()
        assert answered_while_parsing, "a Check waited for the policy parse"
        assert answers == [200, 429]  # the old policy serves until the new one is built
        await eventually(lambda: server.engine.snapshot.policy.version != first)
        assert await client.check("sk_live_x") == 200  # shadow now


async def test_an_oversized_policy_file_is_refused_and_counted(tmp_path: Path) -> None:
    """A file above --policy-max-bytes is not parsed: the last good policy keeps serving and
    the failure is counted and shown, naming the file."""
    f = write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    async with running([tmp_path / "p"], reload_interval=0.05, policy_max_bytes=4096) as (server, client):
        first = server.engine.snapshot.policy.version
        assert [await client.check("sk_live_x") for _ in range(2)] == [200, 429]
        write_policy(f, [rate("user-rate", burst=1, mode="shadow")])
        f.write_text(f.read_text() + "#" * 5000 + "\n")  # valid YAML, too big

        async def failed() -> Any:
            _, s = await admin(server, "GET", "/status")
            return s["reload"] if s["reload"]["last_error"] is not None else None

        status = await eventually(failed)
        assert status["failures"] == 1
        assert status["last_error"]["issues"] == [
            f"{f}: the file is larger than 4096 bytes (--policy-max-bytes); not parsed"]
        assert server.engine.snapshot.policy.version == first
        assert await client.check("sk_live_x") == 429  # still the old policy, enforcing


@pytest.mark.slow
async def test_a_policy_near_the_size_bound_reloads_without_holding_the_loop(tmp_path: Path) -> None:
    """A valid 0.88 MiB policy of 12,000 rules (the size bound is 1 MiB) swapped in by the
    server's reload job while a probe sleeps 1 ms in a loop. Measured in CPU, so that neither
    the machine's speed nor other processes' turns on it decide: within any one gap between
    wake-ups this process's Python threads (those that can hold the GIL: not gRPC's native
    ones, which a process_time() probe counted too) used less than a twenty-fifth of the CPU
    the whole reload took (here and in its child). Parsed in a worker thread, the collector's
    passes over the parse's YAML nodes held the GIL, and the loop, for 0.26-0.4 s of 1.7 s
    (a fifth: over four times this bound); in a child, 4-6 ms of 1.1-2 s, a tenth of it
    (bench/reload_lag.py). A broken one comes back from the child with its file and line,
    the last good policy serving."""
    text = big_policy(12_000)
    assert 0.8 * (1 << 20) < len(text.encode()) < MAX_FILE_BYTES
    lag, watcher = await reload_lag(tmp_path, text)
    assert lag.wakeups >= 20, lag  # the loop ran all along
    assert lag.max_busy < lag.reload_cpu / 25, lag
    assert watcher.reloads == 1
    serving = watcher.version

    (tmp_path / "api.yaml").write_text(text.replace("tier: critical", "tier: urgent", 1))
    assert await watcher.poll() is False
    assert watcher.failures == 1 and watcher.version == serving
    err = watcher.status()["last_error"]
    assert isinstance(err, dict)
    assert err["issues"] == [
        f"{tmp_path / 'api.yaml'}:10: classification.rules[1].tier: Input should be 'critical', "
        "'post', 'get' or 'test' (got 'urgent')"]


async def test_a_policy_built_elsewhere_is_rebuilt_a_piece_per_loop_step(tmp_path: Path) -> None:
    """What a child sends back: the policy in pieces of at most PIECE rules (and limiters),
    rebuilt equal to the one the child built, one piece per loop step, so no step of the loop
    rebuilds more than PIECE rules; the swap does not walk the rules (what it needs was
    computed when the policy was compiled)."""
    (tmp_path / "api.yaml").write_text(big_policy(1_000))
    policy = load_policy([tmp_path])
    pieces = reload_module.pack(policy)
    assert len(pieces) == 1_000 // reload_module.PIECE + 1 + 1  # rule pieces, the limiter, the rest
    steps = 0
    stop = asyncio.Event()

    async def count_steps() -> None:
        nonlocal steps
        while not stop.is_set():
            steps += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_steps())
    await asyncio.sleep(0)
    rebuilt = await reload_module.unpack(pieces)
    stop.set()
    await counter
    assert rebuilt == policy and rebuilt.needed_headers == policy.needed_headers == {"x-api-key"}
    assert steps >= len(pieces) - 1


async def test_small_policies_are_parsed_in_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ISOLATE_BYTES no child is started (it costs more than the parse); above, the
    child parses and this process does not."""
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    engine, watcher = watcher_for(tmp_path / "p", ManualClock())
    started: list[object] = []
    real = reload_module.load_elsewhere

    async def counted(*args: Any, **kwargs: Any) -> Any:
        started.append(args)
        return await real(*args, **kwargs)

    monkeypatch.setattr(reload_module, "load_elsewhere", counted)
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=2)])
    assert await watcher.poll() is True and started == []
    big = (tmp_path / "p" / "api.yaml").read_text() + "#" * reload_module.ISOLATE_BYTES + "\n"
    (tmp_path / "p" / "api.yaml").write_text(big.replace("burst: 2", "burst: 3"))
    monkeypatch.setattr(reload_module, "load_policy", None)  # this process must not parse it
    assert await watcher.poll() is True and len(started) == 1
    assert await allowed_in_a_row(engine, "sk_live_c") == 3


async def test_a_reload_cancelled_by_the_server_stopping_kills_its_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload job cancelled while a child parses (the server stopping): the child is
    killed at once, not left parsing nor waited for at exit."""
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    engine, watcher = watcher_for(tmp_path / "p", ManualClock())
    (tmp_path / "p" / "api.yaml").write_text(big_policy(1_000))
    children: list[asyncio.subprocess.Process] = []
    real = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        children.append(await real(*args, **kwargs))
        return children[-1]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    job = asyncio.create_task(watcher.poll())
    await eventually(lambda: children)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert children[0].returncode == -9  # killed (SIGKILL), and reaped
    assert watcher.version == engine.snapshot.policy.version and watcher.reloads == 0


def spawned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The parser children started from now on (each one's arguments, then its process
    once it started)."""
    started: list[tuple[Any, ...]] = []
    real = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        started.append(args)
        child = await real(*args, **kwargs)
        started[-1] = (*args, child)
        return child

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    return started


@pytest.mark.parametrize("python", ["missing", "fails", "hangs", "garbage"])
async def test_a_parser_child_that_fails_is_a_failed_reload_tried_again_only_when_the_files_change(
        tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, python: str) -> None:
    """The child's interpreter missing, exiting 1 at once, never answering (killed after
    ``child_timeout``), or answering what does not unpickle: the last good policy serves,
    the failure is logged, counted and shown once, and the same content is not handed to a
    new child on every poll (each poll started one, its error escaped the job uncounted, and
    ``last_error`` stayed None). New content is tried again, and applies once the child
    works."""
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    garbage = tmp_path / "garbage"
    garbage.write_text("#!/bin/sh\ncat >/dev/null\necho not a pickle\n")
    garbage.chmod(0o755)
    executable = {"missing": str(tmp_path / "no-such-python"), "fails": shutil.which("false"),
                  "hangs": str(hangs), "garbage": str(garbage)}[python]
    assert executable is not None
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    policy = load_policy([tmp_path / "p"])
    engine, _ = engine_for(policy, clock)
    watcher = PolicyWatcher([tmp_path / "p"], engine.set_policy, current=policy, clock=clock,
                            python=executable, child_timeout=0.5)
    started = spawned(monkeypatch)
    text = big_policy(300)
    assert len(text.encode()) > reload_module.ISOLATE_BYTES  # parsed in a child
    (tmp_path / "p" / "api.yaml").write_text(text)
    with caplog.at_level(logging.ERROR, logger="extauthz.reload"):
        for _ in range(4):
            assert await watcher.poll() is False
    assert len(started) == 1  # not tried again while the content is the same
    assert watcher.failures == 1 and watcher.reloads == 0
    assert engine.snapshot.policy.version == policy.version == watcher.version
    assert len([r for r in caplog.records if r.name == "extauthz.reload"]) == 1
    err = watcher.status()["last_error"]
    assert isinstance(err, dict) and len(err["issues"]) == 1, err
    assert err["issues"][0].startswith(
        "parsing in a child process failed (not tried again until the files change): "), err
    if python == "hangs":
        assert "took more than 0.5 s; killed" in err["issues"][0]
        assert started[0][-1].returncode == -9  # killed and reaped, not left sleeping

    (tmp_path / "p" / "api.yaml").write_text(big_policy(301))  # new content: tried again
    assert await watcher.poll() is False
    assert len(started) == 2 and watcher.failures == 2
    watcher.python, watcher.child_timeout = sys.executable, reload_module.CHILD_TIMEOUT
    (tmp_path / "p" / "api.yaml").write_text(big_policy(302))
    assert await watcher.poll() is True
    assert watcher.last_error is None and watcher.reloads == 1 and len(started) == 3


async def test_a_parser_child_in_another_directory_imports_this_extauthz(
        tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child gets this process's ``sys.path``: an interpreter that has no extauthz of its
    own (as a zipapp's, a pex's, or one running a source tree), started in another directory,
    still imports this one and parses (it failed with ModuleNotFoundError)."""
    write_policy(tmp_path / "p" / "api.yaml", [rate("user-rate", burst=1)])
    policy = load_policy([tmp_path / "p"])
    engine, _ = engine_for(policy, clock)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    base = getattr(sys, "_base_executable", sys.executable)  # outside this virtualenv
    watcher = PolicyWatcher([tmp_path / "p"], engine.set_policy, current=policy, clock=clock, python=base)
    (tmp_path / "p" / "api.yaml").write_text(big_policy(300))
    assert await watcher.poll() is True, watcher.status()["last_error"]
    assert len(engine.snapshot.policy.rules) == 300
