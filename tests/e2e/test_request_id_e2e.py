"""Issue 20 defects 2 and 6 through real Envoy with the shipped configs: a client cannot free
its own slots with a chosen ``x-request-id``, and dot-segments or escaped slashes cannot
reach another route's tier."""

from __future__ import annotations

import json
import select
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack
from testinfra.envoy_configs import DEFAULT_CONFIG, HTTP_CONFIG, config_path

from ..conftest import ROOT

pytestmark = pytest.mark.e2e

LIMIT = 20
KEY = "sk_live_reuser"


def write_policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}],
        "limiters": [{"name": "user-concurrency", "type": "concurrent_requests",
                      "limit": LIMIT, "lease_ttl": "60s"}],
    }))
    return directory


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    [listener] = config["static_resources"]["listeners"]
    [manager] = [f for chain in listener["filter_chains"] for f in chain["filters"]
                 if f["name"] == "envoy.filters.network.http_connection_manager"]
    typed: dict[str, Any] = manager["typed_config"]
    return typed


def keeping_client_ids(config: dict[str, Any]) -> None:
    """envoy.yaml as before the fix: Envoy keeps a client's x-request-id (no
    ``use_remote_address``), so only the server stands between the client and its slots."""
    hcm(config)["use_remote_address"] = False


def status(stack: Stack) -> dict[str, Any]:
    assert stack.server is not None
    url = f"http://127.0.0.1:{stack.server.admin_port}/status"
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as resp:
        body: dict[str, Any] = json.load(resp)
    return body


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.002)


def open_slow(url: str, request_id: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(f"GET /v1/slow?delay=30 HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
                 f"x-request-id: {request_id}\r\n\r\n".encode())
    return sock


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.fixture(params=["shipped", "client_ids_kept", "shipped_http"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    """envoy.yaml, envoy.yaml keeping client ids (before the fix), envoy-http.yaml."""
    render: dict[str, Any] = {"edit": keeping_client_ids} if request.param == "client_ids_kept" else {}
    protocol = "http" if request.param == "shipped_http" else "grpc"
    with Stack([write_policy(tmp_path / "p")], protocol=protocol, **render) as s:
        yield s


def test_a_chosen_request_id_on_an_unchecked_route_frees_no_slot(client: HttpClient, stack: Stack) -> None:
    """The attack of issue 20 (defect 2): slow requests, each followed by ``/healthz`` (ext_authz
    off) with the same ``x-request-id``. Before the fix 40 of 40 were admitted against a limit
    of 20: the health request's access-log entry released the slow request's lease."""
    upstream = stack.upstream
    assert upstream is not None
    socks: list[socket.socket] = []
    admitted = refused = 0
    try:
        for i in range(2 * LIMIT):
            rid = f"chosen-{i}"
            socks.append(sock := open_slow(stack.url, rid))
            wait_for(lambda n=admitted, s=sock: upstream.inflight > n or answered(s),  # type: ignore[misc]
                     "the slow request's check")
            if upstream.inflight > admitted:
                admitted += 1
            else:
                assert b" 429 " in sock.recv(4096).split(b"\r\n", 1)[0]
                refused += 1
            entries = status(stack)["access_log"]["entries"]
            assert client.send(stack.url + "/healthz", headers={"x-request-id": rid}).status == 200
            # the health request's entry has reached the server (and acted, if it could)
            wait_for(lambda n=entries: status(stack)["access_log"]["entries"] > n,  # type: ignore[misc]
                     "the /healthz entry")
        assert (admitted, refused) == (LIMIT, LIMIT)
        assert upstream.max_inflight == LIMIT
        after = status(stack)
        assert sum(after["lease_releases"]["by_path"]["request_id_index"].values()) == 0
        # the admitted ones await their entries in the index (/status counts entries)
        assert after["access_log"]["request_id_index"]["entries"] == after["access_log"]["awaiting_log"] == LIMIT
    finally:
        for sock in socks:
            sock.close()


def test_the_shipped_config_replaces_a_client_request_id(client: HttpClient, tmp_path: Path) -> None:
    with Stack([write_policy(tmp_path / "p")]) as s:
        r = client.send(s.url + "/v1/x", headers={"x-request-id": "chosen", "x-api-key": KEY})
        assert r.status == 200
        seen = r.json()
        assert isinstance(seen, dict)
        rid = seen["headers"]["x-request-id"]
        assert rid and rid != "chosen"


# -- defect 6: one normalized path for routes, the check and the upstream ---------------------

DOT_SEGMENTS = ["/v1/charges/../customers", "/v1/charges/%2e%2e/customers",
                "/v1/charges/%2E%2E/customers", "/v1/charges/./../customers"]


@pytest.fixture(scope="module", params=[DEFAULT_CONFIG, HTTP_CONFIG])
def quickstart(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The README quick start (policies/) on each shipped config that tags ``POST
    /v1/charges`` critical by route."""
    protocol = "http" if request.param == HTTP_CONFIG else "grpc"
    with Stack([ROOT / "policies"], protocol=protocol) as s:
        yield s


@pytest.mark.parametrize("path", DOT_SEGMENTS)
def test_dot_segments_reach_the_upstream_normalized_and_not_critical(
        client: HttpClient, quickstart: Stack, path: str) -> None:
    r = client.send(quickstart.url + path, method="POST", headers={"x-api-key": "sk_live_dots"})
    assert r.status == 200
    seen = r.json()
    assert isinstance(seen, dict)
    assert seen["path"] == "/v1/customers"
    assert r.tier != "critical"
    # the route match still works on the normalized path
    direct = client.send(quickstart.url + "//v1//charges/./c1", method="POST",
                         headers={"x-api-key": "sk_live_dots"})
    assert direct.status == 200 and direct.tier == "critical"


@pytest.mark.parametrize("path", ["/v1/charges%2F..%2Fcustomers", "/v1/charges%5C..%5Ccustomers"])
def test_an_escaped_slash_is_redirected_to_the_unescaped_path(
        client: HttpClient, quickstart: Stack, path: str) -> None:
    assert quickstart.upstream is not None
    served = quickstart.upstream.served
    r = client.send(quickstart.url + path, method="POST", headers={"x-api-key": "sk_live_dots"})
    assert r.status == 307
    assert urlsplit(r.headers["location"]).path == "/v1/customers"
    assert quickstart.upstream.served == served  # nothing reached the upstream


EDGE_FIELDS = {"use_remote_address": True, "normalize_path": True, "merge_slashes": True,
               "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT"}


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-tls.yaml", "envoy-jwt.yaml", "envoy-http.yaml",
                                  "istio-like.yaml"])
def test_every_shipped_connection_manager_generates_request_ids_and_normalizes_paths(name: str) -> None:
    manager = hcm(yaml.safe_load(config_path(name).read_text()))
    assert {k: manager.get(k) for k in EDGE_FIELDS} == EDGE_FIELDS
    # no field that would keep a client's x-request-id or trust its x-forwarded-for
    assert not manager.get("preserve_external_request_id")
    assert "internal_address_config" not in manager and "xff_num_trusted_hops" not in manager
