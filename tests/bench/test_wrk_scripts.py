"""The harness's wrk scripts (bench/load.py) against a tiny HTTP server that records each
request's API key: the flood mix alternates the flooding key with the rotating keys, the
paced script never sends ahead of its schedule, and the latency line is read back.
No timing assertions: only what was sent."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from bench.load import CALM_PREFIX, FLOOD_KEY, read_wrk_latency, run_wrk, run_wrk_pair, wrk_script

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed")


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Envoy answers
    keys: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Recorder.keys.append(self.headers.get("x-api-key", ""))
        self.send_response(429 if self.headers.get("x-api-key") == FLOOD_KEY else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.keys = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_flood_mix_alternates_the_flooding_key_with_rotating_keys(server: str, tmp_path: Path) -> None:
    script = wrk_script(tmp_path, 50, name="flood.lua", flood_key=FLOOD_KEY)
    res = run_wrk(server, 1, script, threads=1, connections=1)
    keys = Recorder.keys
    assert len(keys) >= 20 and res["requests"] >= len(keys) - 1
    flood = [k for k in keys if k == FLOOD_KEY]
    assert abs(len(flood) - len(keys) / 2) <= 1  # every other request
    others = [k for k in keys if k != FLOOD_KEY]
    assert all(k.startswith("bench-user-") for k in others)
    assert len(set(others)) == min(50, len(others))  # rotating: no key twice before all 50
    assert res["non_2xx"] == len(flood) or abs(res["non_2xx"] - len(flood)) <= 1
    assert {"p50_ms", "p99_ms", "p999_ms"} <= set(res)


def test_paced_pair_keeps_to_its_schedule_and_reports_each_load(server: str, tmp_path: Path) -> None:
    calm = wrk_script(tmp_path, name="paced-users.lua", rate=50)
    other = wrk_script(tmp_path, name="paced-calm.lua", prefix=CALM_PREFIX, rate=50)
    first, second = run_wrk_pair(server, 1, (calm, other), connections=4)
    keys = Recorder.keys
    # never ahead of the schedule: one request per 20 ms per load (over wrk's own measure of
    # the run's length; + one per connection at the edges)
    for res in (first, second):
        assert 0 < res["requests"] <= 50 * res["seconds"] + 5, (first, second)
    assert sum(k.startswith(CALM_PREFIX) for k in keys) >= second["requests"]
    assert sum(k.startswith("bench-user-") for k in keys) >= first["requests"]
    assert first["p99_ms"] >= first["p50_ms"] > 0


def test_latency_line() -> None:
    assert read_wrk_latency("...\nLATENCY_US p50 1500 p99 4200 p999 9000\n") == {
        "p50_ms": 1.5, "p99_ms": 4.2, "p999_ms": 9.0}
    assert read_wrk_latency("no line") == {}
