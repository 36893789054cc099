"""Two ``extauthz serve`` processes on one host with only ``--listen`` differing both start,
answer Check and can each be reached by the operator commands; a port asked for that is
taken still fails the start with a clear message."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from extauthz.devtools.stack import free_port, wait_for_health
from extauthz.proto import auth_pb2, auth_pb2_grpc

from ..conftest import ROOT

pytestmark = pytest.mark.slow


def _env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXTAUTHZ_")}
    return {**env, "XDG_RUNTIME_DIR": str(runtime), "EXTAUTHZ_LOG_FORMAT": "text"}


def _serve(runtime: Path, *args: str, output: Path | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "extauthz", "serve", "--policies", str(ROOT / "policies"), *args]
    with contextlib.ExitStack() as files:  # the child keeps its own copy of the log file
        out = files.enter_context(output.open("wb")) if output is not None else subprocess.PIPE
        return subprocess.Popen(cmd, env=_env(runtime), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)


def _cli(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extauthz", *args], env=_env(runtime), text=True,
                          capture_output=True, timeout=30, check=False)


def _check(port: int, key: str) -> auth_pb2.CheckResponse:
    req = auth_pb2.CheckRequest()
    req.attributes.request.http.method = "GET"
    req.attributes.request.http.path = "/v1/things"
    req.attributes.request.http.headers["x-api-key"] = key
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return auth_pb2_grpc.AuthorizationStub(channel).Check(req, timeout=5)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_two_servers_with_only_listen_given_both_start_and_answer(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    # One after the other: a port is picked only once the previous server holds its ports, so
    # free_port() cannot hand out a port that the first server's OS-chosen admin port takes
    # meanwhile. Each server's output goes to a file that a start failure shows.
    ports: list[int] = []
    for i in range(2):
        port = free_port()
        log = tmp_path / f"serve-{i}.log"
        processes.append(_serve(tmp_path, "--listen", f"127.0.0.1:{port}", output=log))
        wait_for_health(port, 30, processes[-1], log)
        assert _check(port, "sk_live_a").status.code == 0
        ports.append(port)
    for port in ports:  # both still answer
        assert _check(port, "sk_live_b").status.code == 0
    urls = [(tmp_path / "extauthz" / f"admin-{p}.url").read_text().strip() for p in ports]
    assert urls[0] != urls[1] and all(u.startswith("http://127.0.0.1:") for u in urls)
    # the operator commands reach each server by the --listen it was started with
    for port in ports:
        status = _cli(tmp_path, "status", "--json", "--listen", f"127.0.0.1:{port}")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["policy"]["version"]
        switches = _cli(tmp_path, "switch", "--listen", f"127.0.0.1:{port}", "--list")
        assert switches.returncode == 0 and "user-rate" in switches.stdout
    missing = _cli(tmp_path, "status", "--listen", f"127.0.0.1:{free_port()}")
    assert missing.returncode == 1 and "wrote" in missing.stderr

    # a port asked for explicitly that is taken fails the start, saying which and why
    admin_port = int(urls[0].rsplit(":", 1)[1])
    taken = _serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{admin_port}")
    processes.append(taken)
    out = taken.communicate(timeout=30)[0].decode()
    assert taken.returncode == 2
    assert f"cannot listen on 127.0.0.1:{admin_port} (--admin-listen)" in out
    busy = _serve(tmp_path, "--listen", f"127.0.0.1:{ports[0]}")
    processes.append(busy)
    out = busy.communicate(timeout=30)[0].decode()
    assert busy.returncode == 2
    assert f"cannot listen on 127.0.0.1:{ports[0]} (--listen)" in out

    # a clean stop removes the URL file
    processes[1].terminate()
    processes[1].wait(10)
    assert not (tmp_path / "extauthz" / f"admin-{ports[1]}.url").exists()


def test_the_operator_commands_find_a_restarted_server_with_their_defaults(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    # A rolling restart on one host: the new server starts beside the old one (--reuse-port)
    # while it still holds its admin port, so the new one gets an OS-chosen admin port; then
    # the old one drains and exits. The commands with no --admin/--listen (EXTAUTHZ_LISTEN
    # names the servers' --listen, as it does for serve) must reach the new one.
    port = free_port()
    listen = f"127.0.0.1:{port}"
    old = _serve(tmp_path, "--listen", listen, "--reuse-port", output=tmp_path / "old.log")
    processes.append(old)
    wait_for_health(port, 30, old, tmp_path / "old.log")
    url_file = tmp_path / "extauthz" / f"admin-{port}.url"
    old_url = url_file.read_text().strip()
    new = _serve(tmp_path, "--listen", listen, "--reuse-port", output=tmp_path / "new.log")
    processes.append(new)
    # the old one answers health on the shared port too: the new one is up once it wrote the file
    deadline = time.monotonic() + 30
    while url_file.read_text().strip() == old_url:
        assert new.poll() is None and time.monotonic() < deadline, (tmp_path / "new.log").read_text()
        time.sleep(0.05)
    new_url = url_file.read_text().strip()
    old.terminate()
    assert old.wait(30) == 0
    assert url_file.read_text().strip() == new_url  # the old one left the new one's file alone

    env_listen = {"EXTAUTHZ_LISTEN": listen}
    status = subprocess.run([sys.executable, "-m", "extauthz", "status", "--json"], text=True, capture_output=True,
                            timeout=30, check=False, env={**_env(tmp_path), **env_listen})
    assert status.returncode == 0, status.stderr
    assert f"extauthz: admin port {new_url}" in status.stderr
    assert json.loads(status.stdout)["policy"]["version"]
    switch = subprocess.run([sys.executable, "-m", "extauthz", "switch", "user-rate", "shadow", "--reason",
                             "restart test"], text=True, capture_output=True, timeout=30, check=False,
                            env={**_env(tmp_path), **env_listen})
    assert switch.returncode == 0, switch.stderr
    assert f"ok: user-rate -> shadow on {new_url}" in switch.stdout
