"""A limiter in Envoy (``enforce: envoy``) keyed on a header and the method, through a real
Envoy 1.40: the bucket ids Envoy reports are the check's keys, whatever case a method is sent
in over HTTP/2 (``gEt`` is GET) and however often a key header is repeated (``k,k`` is one
bucket shared by every such request, never a bucket of its own per spelling, each with the
limiter's whole rate)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
import yaml

from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess
from extauthz.engine.quota_service import REPORT_INTERVAL
from extauthz.envoy.config import bootstrap
from extauthz.policy import load_policy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICY = ("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
          "  - {name: key-rate, type: request_rate, rate: 100, burst: 100, enforce: envoy,\n"
          "     key: [{header: x-api-key}, {method: true}]}\n")
#: how long the server or Envoy may take to start on a loaded machine (no measurement here)
STARTUP = 60.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _buckets(server: ServerProcess) -> list[dict[str, str]]:
    with _OPENER.open(f"http://127.0.0.1:{server.admin_port}/status", timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return [b["bucket"] for s in doc["quota"]["streams"] for b in s["buckets"]]


def _h2(url: str, method: str, headers: list[tuple[str, str]]) -> str:
    """One HTTP/2 request (prior knowledge) with ``method`` as given; its status."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8", validate_outbound_headers=False))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", method), (":path", "/x"), (":scheme", "http"), (":authority", "a"),
                              *headers], end_stream=True)
        sock.sendall(conn.data_to_send())
        for _ in range(20):
            data = sock.recv(65535)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    return str(dict(event.headers)[":status"])
                if isinstance(event, h2.events.StreamReset):
                    return f"reset {event.error_code}"
            sock.sendall(conn.data_to_send())
    return "none"


def test_envoy_s_bucket_ids_are_the_check_s_keys(tmp_path: Path) -> None:
    (tmp_path / "api.yaml").write_text(POLICY)
    server = ServerProcess([tmp_path]).start(STARTUP)
    config = yaml.safe_dump(bootstrap(load_policy([tmp_path]), protocol="grpc", upstream=("127.0.0.1", 9),
                                      authz=("127.0.0.1", server.port), listen_port=0, admin_port=0, rlqs=True,
                                      direct_response=True))
    try:
        with EnvoyProcess(config, startup_timeout=STARTUP) as envoy:
            # the key k in four method spellings, and repeated (Envoy joins repeats with ",")
            sent = [("GET", [("x-api-key", "k")]), ("gEt", [("x-api-key", "k")]), ("get", [("x-api-key", "k")]),
                    ("GET", [("x-api-key", "k"), ("x-api-key", "k")]),
                    ("get", [("x-api-key", "k"), ("x-api-key", "k"), ("x-api-key", "k")]),
                    ("GET", [("x-api-key", "k,k")])]
            # then a marker of its own (PUT): the one stream carries reports in order, so once
            # its bucket is in, every bucket before it is
            for method, headers in [*sent, ("PUT", [("x-api-key", "z")])]:
                # a bucket's first request waits for its assignment: 429
                assert _h2(envoy.url, method, headers) in ("200", "429"), (method, headers)
            deadline = time.monotonic() + 3 * REPORT_INTERVAL
            buckets = _buckets(server)
            while "PUT" not in {b["method"] for b in buckets} and time.monotonic() < deadline:
                time.sleep(0.2)
                buckets = _buckets(server)
    finally:
        server.stop()
    # besides the marker, two buckets, both GET: k itself, and the one every repeated key shares
    assert "PUT" in {b["method"] for b in buckets}, buckets
    buckets = [b for b in buckets if b["method"] != "PUT"]
    assert len(buckets) == 2, buckets
    assert {b["method"] for b in buckets} == {"GET"}
    assert {b["limiter"] for b in buckets} == {"key-rate"}
    assert len({b["header:x-api-key"] for b in buckets}) == 2
