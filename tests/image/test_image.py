"""The container image: built from ./Containerfile by scripts/build-image on a local Debian base
(no registry, no Docker engine), then started with buildah and asked for health and a Check.

The base comes from Debian's packages (``mmdebstrap``: python3, python3-venv, libstdc++6 for
grpcio, ca-certificates) and is cached: the tarball under ``$EXTAUTHZ_TEST_CACHE`` (default
``~/.cache/extauthz-tests``) and the imported image in buildah's store, both named by a hash of
the inputs below, so only the first run on a machine pays for it (about a minute).
Skipped, with the reason, where buildah or mmdebstrap is missing or we are not root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from extauthz.devtools.stack import free_port, wait_for_health
from extauthz.proto import auth_pb2_grpc

from ..conftest import ROOT
from ..integration.test_server import check_request

pytestmark = [pytest.mark.image, pytest.mark.slow]

USER_ID = 65532
SUITE = "bookworm"
VARIANT = "essential"
PACKAGES = ("python3", "python3-venv", "libstdc++6", "ca-certificates")
DPKG_OPTS = tuple(f"path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale"))
TEST_IMAGE = "localhost/extauthz-image-test"


def _missing() -> str | None:
    for tool in ("buildah", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/install-system-deps.sh installs it; apt-get install {tool})"
    if os.geteuid() != 0:
        return "buildah/mmdebstrap image builds here need root (chroot isolation)"
    return None


_why = _missing()
if _why is not None:
    pytestmark.append(pytest.mark.skip(reason=_why))


def buildah(*args: str, timeout: float = 300) -> str:
    out = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def mmdebstrap_args(target: Path) -> list[str]:
    return ["mmdebstrap", f"--variant={VARIANT}", "--include=" + ",".join(PACKAGES),
            *(f"--dpkgopt={o}" for o in DPKG_OPTS), SUITE, str(target)]


def base_key() -> str:
    version = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True, check=True).stdout
    inputs = json.dumps([version.strip(), mmdebstrap_args(Path("base.tar"))])
    return hashlib.sha256(inputs.encode()).hexdigest()[:16]


def ensure_base() -> tuple[str, float | None]:
    """The local base image's name, and the seconds a cold mmdebstrap took (None: cached)."""
    key = base_key()
    name = f"localhost/extauthz-base:{SUITE}-{key}"
    if subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0:
        return name, None
    cache = Path(os.environ.get("EXTAUTHZ_TEST_CACHE", Path.home() / ".cache" / "extauthz-tests")) / "image-base"
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{SUITE}-{key}.tar"
    cold = None
    if not tarball.exists():
        started = time.monotonic()
        partial = tarball.with_suffix(f".{os.getpid()}.partial.tar")  # concurrent runs: last rename wins
        subprocess.run(mmdebstrap_args(partial), check=True, capture_output=True, timeout=900)
        partial.rename(tarball)
        cold = time.monotonic() - started
    container = buildah("from", "scratch").strip()
    try:
        buildah("add", container, str(tarball), "/")
        buildah("commit", "--quiet", container, name)
    finally:
        buildah("rm", container)
    return name, cold


@dataclass
class Built:
    name: str
    base: str
    seconds: float


@pytest.fixture(scope="module")
def image() -> Iterator[Built]:
    base, cold = ensure_base()
    if cold is not None:
        print(f"\nimage base: mmdebstrap cold build took {cold:.0f} s")
    started = time.monotonic()
    tag = f"test-{os.getpid()}"  # concurrent runs on one machine never share (or remove) an image
    env = {**os.environ, "BASE": base, "IMAGE": TEST_IMAGE, "TAG": tag}
    out = subprocess.run([str(ROOT / "scripts" / "build-image")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    name = out.stdout.strip().splitlines()[-1]
    built = Built(name, base, time.monotonic() - started)
    size = buildah("images", "--format", "{{.Size}}", name).strip()
    print(f"\nimage {name}: built in {built.seconds:.0f} s, size {size} (base {base})")
    yield built
    buildah("rmi", name)


@pytest.fixture
def container(image: Built) -> Iterator[str]:
    name = buildah("from", "--pull-never", image.name).strip()
    yield name
    buildah("rm", name)


def run_in(container: str, *cmd: str) -> str:
    return buildah("run", "--isolation", "chroot", "--network", "host", container, "--", *cmd)


def test_build_image_prints_the_requested_name_last(image: Built) -> None:
    assert image.name == f"{TEST_IMAGE}:test-{os.getpid()}"


def test_image_config(image: Built) -> None:
    info = json.loads(buildah("inspect", "--type", "image", image.name))
    config = info["OCIv1"]["config"]
    assert config["Entrypoint"] == ["extauthz"]
    assert config["Cmd"] == ["serve"]
    assert config["User"] == f"{USER_ID}:{USER_ID}"
    labels = config["Labels"]
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    assert labels["org.opencontainers.image.version"] == version.group(1)
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")


def test_runtime_holds_the_venv_only(container: str) -> None:
    assert run_in(container, "id", "-u").strip() == str(USER_ID)
    listing = run_in(container, "sh", "-c",
                     "ls /opt/extauthz/bin; ls /opt/extauthz/lib/python3*/site-packages; "
                     "for p in /src /wheelhouse /root/.cache/pip /tmp/pip-*; do [ -e $p ] && echo LEFT $p; done; "
                     "for c in cc gcc g++ make; do command -v $c && echo COMPILER $c; done; true")
    names = set(listing.split())
    assert "extauthz" in names and "grpc" in names
    assert not {"pip", "pip3", "setuptools", "wheel"} & names, sorted(names)
    assert not {"tests", "bench"} & names
    assert "LEFT" not in listing and "COMPILER" not in listing, listing
    # the shipped default policy loads inside the image
    assert "ok" in run_in(container, "extauthz", "check-policies", "/etc/extauthz/policies").lower()


def server_pid(port: int, timeout: float = 10.0) -> int:
    """The pid of the image's ``extauthz serve`` listening on ``port`` (found in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # argv[0]: buildah-chroot-exec is the parent; the server is the venv's python
            if argv[0].startswith(b"/opt/extauthz/bin/python") and f"127.0.0.1:{port}".encode() in argv:
                return int(proc.name)
        time.sleep(0.1)
    raise AssertionError(f"no extauthz process for port {port}")


def test_serves_health_and_check_as_non_root(container: str, tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "image.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}],
        "limiters": [{"name": "image-rate", "type": "request_rate", "rate": 1, "burst": 1}],
    }))
    policies.chmod(0o755)
    (policies / "image.yaml").chmod(0o644)
    port, admin = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", "--network", "host",
             "-v", f"{policies}:/etc/extauthz/policies:ro", container, "--",
             "extauthz", "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_health(port, timeout=60, proc=proc, log=log)
        pid = server_pid(port)
        status = (Path("/proc") / str(pid) / "status").read_text()
        uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", status, re.M)
        assert uids is not None and {int(u) for u in uids.groups()} == {USER_ID}, status
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = auth_pb2_grpc.AuthorizationStub(channel)
            ok = stub.Check(check_request(key="sk_live_image"), timeout=5)
            assert ok.HasField("ok_response"), ok
            assert {h.header.key: h.header.value for h in ok.ok_response.headers}["x-extauthz-tier"] == "get"
            denied = stub.Check(check_request(key="sk_live_image"), timeout=5)
            assert denied.denied_response.status.code == 429  # the mounted policy (burst 1) decides
            assert b'"image-rate"' in denied.denied_response.body.encode()
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
        assert "NOT_SERVING" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
