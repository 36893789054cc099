"""The shipped Envoy config: validation, rendering variants, and a real Envoy in front of it."""

from __future__ import annotations

import itertools
import json
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import free_port
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy import config as generator
from extauthz.envoy.config import (
    ACCESS_LOG_BYTES_PER_MS,
    EXT_AUTHZ_FILTER,
    LOCAL_RATELIMIT_FILTER,
    SHIPPED_ACCESS_LOG_FLUSH_MS,
    JwtProvider,
    LocalRateLimit,
    TlsFiles,
    jwks_from_file,
)
from extauthz.policy import load_policy
from testinfra.envoy_configs import (
    GRPC_CONFIGS,
    EnvoyConfigError,
    config_path,
    grpc_cluster_problems,
    load_config_text,
    validate,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SOURCE_CONFIG = REPO / "envoy" / "envoy.yaml"
HTTP_CONFIG = REPO / "envoy" / "envoy-http.yaml"

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


_TLS_DIR = "/etc/envoy/extauthz-tls"
#: the options of each shipped file's command line beyond the quick start's (its header;
#: tests/e2e/test_envoy_bootstrap.py holds each file equal to its command line's output)
SHIPPED_OPTIONS: dict[str, dict[str, Any]] = {
    "envoy.yaml": {},
    "envoy-http.yaml": {"protocol": "http"},
    "envoy-tls.yaml": {"tls": TlsFiles(f"{_TLS_DIR}/tls.crt", f"{_TLS_DIR}/tls.key", f"{_TLS_DIR}/ca.crt")},
    "envoy-jwt.yaml": {"jwt": JwtProvider("https://issuer.example", ("extauthz",),
                                          jwks_from_file(str(REPO / "envoy" / "jwt-demo-jwks.json")))},
}


def render(name: str = "envoy.yaml", **kwargs: Any) -> str:
    """The shipped config ``name`` as the generator renders it, on free loopback ports (the
    listener and admin on port 0), with ``kwargs`` (the generator's options) on top."""
    defaults: dict[str, Any] = {
        "protocol": "grpc",
        "quickstart_routes": True,
        "listen_port": 0,
        "admin_port": 0,
        "authz": ("127.0.0.1", free_port()),
        "upstream": ("127.0.0.1", free_port()),
        "tracing": ("127.0.0.1", free_port()),
        **SHIPPED_OPTIONS[name],
    }
    return generator.render(load_policy([REPO / "policies"]), **(defaults | kwargs))


def http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with _OPENER.open(request, timeout=5) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                response.read(),
            )
    except urllib.error.HTTPError as error:
        return (
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            error.read(),
        )


# ---- static checks ----------------------------------------------------------------------


def test_default_config_is_the_one_in_envoy_dir() -> None:
    # One copy: a checkout reads envoy/ in place (the wheel ships the same files as
    # extauthz/envoy/configs/, checked by tests/store/redis/test_lua.py's wheel test).
    assert config_path() == SOURCE_CONFIG
    assert load_config_text() == SOURCE_CONFIG.read_text(encoding="utf-8")
    assert not list((REPO / "extauthz" / "envoy").rglob("*.yaml"))
    assert not list((REPO / "extauthz" / "devtools").glob("*.yaml"))
    with pytest.raises(FileNotFoundError, match=r"no-such\.yaml"):
        config_path("no-such.yaml")


def test_shipped_config_validates() -> None:
    validate(SOURCE_CONFIG.read_text(encoding="utf-8"))


def test_shipped_http_config_validates() -> None:
    validate(HTTP_CONFIG.read_text(encoding="utf-8"))


def _http_ext_authz() -> dict[str, Any]:
    config = yaml.safe_load(HTTP_CONFIG.read_text(encoding="utf-8"))
    filters = _hcm(config)["http_filters"]
    return next(f["typed_config"] for f in filters if f["name"] == EXT_AUTHZ_FILTER)  # type: ignore[no-any-return]


def test_shipped_http_config_allows_what_the_policy_reads() -> None:
    from extauthz.envoy.headers import allowed_headers
    from extauthz.policy import load_policy

    listed = [p["exact"] for p in _http_ext_authz()["allowed_headers"]["patterns"]]
    assert listed == allowed_headers(load_policy([REPO / "policies"]).needed_headers), (
        "regenerate with `extauthz envoy-allowed-headers policies/`"
    )


@pytest.mark.parametrize("name", GRPC_CONFIGS)
def test_shipped_grpc_configs_allow_what_the_policy_reads_and_strip_the_tier(name: str) -> None:
    from extauthz.engine.answers import TIER_HEADER
    from extauthz.envoy.headers import allowed_headers
    from extauthz.policy import load_policy

    config = yaml.safe_load(config_path(name).read_text(encoding="utf-8"))
    ext = _filters(config)[EXT_AUTHZ_FILTER]
    listed = [p["exact"] for p in ext["allowed_headers"]["patterns"]]
    assert listed == allowed_headers(load_policy([REPO / "policies"]).needed_headers, "grpc"), (
        "regenerate with `extauthz envoy-allowed-headers --protocol grpc policies/`"
    )
    # a client's tier header is removed before anything else runs (the check may fail open)
    first = _hcm(config)["http_filters"][0]
    assert first["name"] == "extauthz.strip-tier"
    assert first["typed_config"]["mutations"]["request_mutations"] == [
        {"remove": TIER_HEADER}, {"remove": "x-envoy-auth-failure-mode-allowed"}]


def test_every_shipped_grpc_config_is_checked() -> None:
    # A new gRPC config in envoy/ must join GRPC_CONFIGS (and so the header checks above);
    # istio-like.yaml and istio-waypoint.yaml are istiod's output, which has no allowed_headers
    # for a gRPC provider;
    # envoy-gateway.yaml is Envoy Gateway's (one ext_authz filter per SecurityPolicy, each named
    # after it, their headers checked against the examples in test_envoy_gateway_e2e.py);
    # envoy-rlqs.yaml is policies/rlqs/'s (checked in test_rlqs_envoy.py).
    found = set()
    for path in (REPO / "envoy").glob("*.yaml"):
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        if "static_resources" not in config:
            continue  # access-log-json.yaml: an access-log item, not a config
        ext = _filters(config).get(EXT_AUTHZ_FILTER, {})
        if "grpc_service" in ext:
            found.add(path.name)
    assert found == {*GRPC_CONFIGS, "istio-like.yaml", "istio-waypoint.yaml", "envoy-rlqs.yaml"}
    for name in ("istio-like.yaml", "istio-waypoint.yaml"):
        istio = yaml.safe_load((REPO / "envoy" / name).read_text(encoding="utf-8"))
        assert "allowed_headers" not in _filters(istio)[EXT_AUTHZ_FILTER]


def test_render_sets_or_drops_allowed_headers() -> None:
    listed = _filters(yaml.safe_load(render(allowed_headers=["x-plan", "x-request-id"])))[EXT_AUTHZ_FILTER]
    assert listed["allowed_headers"] == {"patterns": [{"exact": "x-plan"}, {"exact": "x-request-id"}]}
    every = render(send_all_headers=True)
    validate(every)
    assert "allowed_headers" not in _filters(yaml.safe_load(every))[EXT_AUTHZ_FILTER]
    with pytest.raises(ValueError, match="only the gRPC protocol"):
        render(HTTP_CONFIG.name, send_all_headers=True)
    with pytest.raises(ValueError, match="exclude each other"):
        render(allowed_headers=["x-api-key"], send_all_headers=True)
    # without the filter there is nothing to set
    assert EXT_AUTHZ_FILTER not in _filters(yaml.safe_load(render(ext_authz=False, allowed_headers=[])))


def test_render_lists_n_endpoints_of_the_extauthz_cluster() -> None:
    text = render(authz=("127.0.0.1", 9101), authz_endpoints=3)
    validate(text)
    (group,) = _cluster(yaml.safe_load(text), "extauthz")["load_assignment"]["endpoints"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in group["lb_endpoints"]]
    assert ports == [9101, 9102, 9103]
    for n in (0, 65):
        with pytest.raises(ValueError, match=f"authz_endpoints must be 1-64, not {n}"):
            render(authz_endpoints=n)
    with pytest.raises(ValueError, match="out of range"):
        render(authz=("127.0.0.1", 65535), authz_endpoints=2)


def test_shipped_http_config_states_fail_open_shed_mapper_and_lease_metadata() -> None:
    from extauthz.engine.answers import LEASE_FIELDS
    from extauthz.envoy.headers import ROUTE_TIER_HEADER, SHED_STATUS

    ext = _http_ext_authz()
    assert ext["failure_mode_allow"] is True
    assert ext["http_service"]["server_uri"]["timeout"] == "0.25s"
    response = ext["http_service"]["authorization_response"]
    assert [p["exact"] for p in response["dynamic_metadata_from_headers"]["patterns"]] == list(LEASE_FIELDS)
    hcm = _hcm(yaml.safe_load(HTTP_CONFIG.read_text(encoding="utf-8")))
    assert hcm["use_remote_address"] is True
    mapper = hcm["local_reply_config"]["mappers"][0]
    assert mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == SHED_STATUS
    assert mapper["status_code"] == 503
    names = [f["name"] for f in hcm["http_filters"]]
    assert names.index("extauthz.strip-route-tier") < names.index("extauthz.route-tier") < names.index(EXT_AUTHZ_FILTER)
    strip = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert strip == [{"remove": ROUTE_TIER_HEADER}, {"remove": "x-jwt-payload"}, {"remove": "x-extauthz-tier"},
                     {"remove": "x-envoy-auth-failure-mode-allowed"}]


def test_shipped_config_states_fail_open_and_route_metadata() -> None:
    config = yaml.safe_load(SOURCE_CONFIG.read_text(encoding="utf-8"))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = {
        f["name"]: f.get("typed_config", {})
        for f in hcm["typed_config"]["http_filters"]
    }
    ext_authz = filters[EXT_AUTHZ_FILTER]
    assert ext_authz["failure_mode_allow"] is True
    assert ext_authz["grpc_service"]["timeout"] == "0.25s"
    assert ext_authz["route_metadata_context_namespaces"] == ["extauthz"]


@pytest.mark.parametrize(
    ("access_log", "ext_authz", "ratelimit", "direct"),
    list(itertools.product([True, False], repeat=4)),
)
def test_rendered_variants_validate(
    access_log: bool, ext_authz: bool, ratelimit: bool, direct: bool
) -> None:
    text = render(
        access_log="always" if access_log else "never",
        ext_authz=ext_authz,
        local_ratelimit=LocalRateLimit(max_tokens=100, fill_interval=0.5)
        if ratelimit
        else None,
        direct_response=direct,
    )
    validate(text)
    hcm = _hcm(yaml.safe_load(text))
    names = [f["name"] for f in hcm["http_filters"]]
    assert (EXT_AUTHZ_FILTER in names) is ext_authz
    assert (LOCAL_RATELIMIT_FILTER in names) is ratelimit
    assert names[-1] == "envoy.filters.http.router"
    loggers = [a["name"] for a in hcm.get("access_log", [])]
    assert ("envoy.access_loggers.http_grpc" in loggers) is (access_log and ext_authz)
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routed = [r for r in routes if r.get("route", {}).get("cluster") == "upstream"]
    assert (not routed) is direct
    if not ext_authz:
        assert not any(
            EXT_AUTHZ_FILTER in r.get("typed_per_filter_config", {}) for r in routes
        )


def test_render_without_tracing_and_with_host_names_validates() -> None:
    text = render(tracing=None, upstream=("localhost", 8080))
    validate(text)
    config = yaml.safe_load(text)
    assert "tracing" not in _hcm(config)
    assert _cluster(config, "upstream")["type"] == "STRICT_DNS"


def test_render_with_buffered_access_log_validates() -> None:
    text = render(access_log_flush_ms=5)
    validate(text)
    (grpc_log,) = [
        a for a in _hcm(yaml.safe_load(text))["access_log"]
        if a["name"] == "envoy.access_loggers.http_grpc"
    ]
    common = grpc_log["typed_config"]["common_config"]
    assert common["buffer_flush_interval"] == "0.005s"
    assert common["buffer_size_bytes"] == 5 * ACCESS_LOG_BYTES_PER_MS  # the size to match 5 ms
    twenty = _hcm(yaml.safe_load(render(access_log_flush_ms=20)))["access_log"][0]["typed_config"]["common_config"]
    assert (twenty["buffer_size_bytes"], twenty["buffer_flush_interval"]) == (16384, "0.020s")
    zero = _hcm(yaml.safe_load(render(access_log_flush_ms=0)))["access_log"][0]["typed_config"]["common_config"]
    assert zero["buffer_size_bytes"] == 0  # every entry at once
    with pytest.raises(ValueError, match="negative"):
        render(access_log_flush_ms=-1)


@pytest.mark.parametrize("name", [*GRPC_CONFIGS, HTTP_CONFIG.name])
def test_shipped_configs_batch_the_access_log_as_chosen(name: str) -> None:
    config = yaml.safe_load(config_path(name).read_text(encoding="utf-8"))
    (grpc_log,) = [a for a in _hcm(config)["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"]
    common = grpc_log["typed_config"]["common_config"]
    assert common["buffer_flush_interval"] == f"{SHIPPED_ACCESS_LOG_FLUSH_MS / 1000:.3f}s"
    assert common["buffer_size_bytes"] == round(SHIPPED_ACCESS_LOG_FLUSH_MS * ACCESS_LOG_BYTES_PER_MS)


def test_render_sets_ports_and_endpoints_by_cluster_name() -> None:
    text = render(
        listen_port=11000,
        admin_port=11001,
        authz=("127.0.0.2", 11002),
        upstream=("127.0.0.3", 11003),
        tracing=("127.0.0.4", 11004),
    )
    config = yaml.safe_load(text)
    assert config["admin"]["address"]["socket_address"]["port_value"] == 11001
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 11000
    for name, host, port in [
        ("extauthz", "127.0.0.2", 11002),
        ("upstream", "127.0.0.3", 11003),
        ("otel_collector", "127.0.0.4", 11004),
    ]:
        lb = _cluster(config, name)["load_assignment"]["endpoints"][0]["lb_endpoints"][
            0
        ]
        assert lb["endpoint"]["address"]["socket_address"] == {
            "address": host,
            "port_value": port,
        }


def test_cluster_reference_check_catches_undefined_grpc_cluster() -> None:
    config = yaml.safe_load(render())
    ext_authz = next(
        f for f in _hcm(config)["http_filters"] if f["name"] == EXT_AUTHZ_FILTER
    )
    ext_authz["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = (
        "ext-authz-typo"
    )
    broken = yaml.safe_dump(config, sort_keys=False)

    problems = grpc_cluster_problems(broken)
    assert len(problems) == 1
    index = [f["name"] for f in _hcm(config)["http_filters"]].index(EXT_AUTHZ_FILTER)
    assert (
        f"http_filters[{index}].typed_config.grpc_service.envoy_grpc.cluster_name"
        in problems[0]
    )
    assert "'ext-authz-typo'" in problems[0]
    with pytest.raises(EnvoyConfigError, match="ext-authz-typo"):
        validate(broken)


def test_validate_reports_envoy_output() -> None:
    broken = render().replace("failure_mode_allow: true", "failure_mode_alow: true")
    with pytest.raises(EnvoyConfigError, match="failure_mode_alow"):
        validate(broken)


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    # envoy-gateway.yaml: Envoy Gateway's default_filter_chain
    chain = listener["filter_chains"][0] if "filter_chains" in listener else listener["default_filter_chain"]
    return chain["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


# ---- a real Envoy ---------------------------------------------------------------------


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with start_upstream("127.0.0.1") as server:
        yield server


def test_fail_open_when_ext_authz_server_is_down(upstream: Upstream) -> None:
    text = render(
        authz=("127.0.0.1", free_port()), upstream=("127.0.0.1", upstream.port)
    )
    with EnvoyProcess(text) as envoy:
        status, _, body = http(envoy.url + "/v1/reports/daily")
        assert status == 200
        echo = json.loads(body)
        assert echo["path"] == "/v1/reports/daily"
        assert echo["tier"] is None
        assert echo["headers"]["x-envoy-auth-failure-mode-allowed"] == "true"
        assert echo["headers"]["x-request-id"]

        status, _, body = http(envoy.url + "/v1/charges", method="POST")
        assert status == 200
        assert json.loads(body)["method"] == "POST"

        status, _, body = http(envoy.url + "/healthz")
        assert (status, body) == (200, b"ok\n")

        stats = envoy.stats(r"ext_authz")
        assert (
            stats["http.ingress_http.ext_authz.failure_mode_allowed"] == 2
        )  # not /healthz
        assert upstream.served == 2


# A fake ext_authz server: grpcio generic handlers and hand-encoded protobuf, so the test
# depends on neither the server package nor generated classes. Field numbers are Envoy's
# (envoy/service/auth/v3/external_auth.proto, attribute_context.proto, core/v3/base.proto).


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _header_option(key: str, value: str) -> bytes:
    header_value = _field(1, key.encode()) + _field(2, value.encode())
    return _field(1, header_value)  # HeaderValueOption.header


def _ok_response(
    upstream_headers: dict[str, str],
    client_headers: dict[str, str],
    metadata: dict[str, str],
) -> bytes:
    ok = b"".join(_field(2, _header_option(k, v)) for k, v in upstream_headers.items())
    ok += b"".join(_field(6, _header_option(k, v)) for k, v in client_headers.items())
    struct = b"".join(
        _field(
            1, _field(1, k.encode()) + _field(2, _field(3, v.encode()))
        )  # Value.string_value
        for k, v in metadata.items()
    )
    return (
        _field(1, b"") + _field(3, ok) + _field(4, struct)
    )  # status OK, ok_response, metadata


def _decode(data: bytes) -> dict[int, list[Any]]:
    """One level of protobuf wire format: field number -> values (bytes or int)."""
    fields: dict[int, list[Any]] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value: Any = varint()
        elif wire_type == 2:
            length = varint()
            value, pos = data[pos : pos + length], pos + length
        elif wire_type == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire_type == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        fields.setdefault(number, []).append(value)
    return fields


def _string_map(entries: list[bytes]) -> dict[str, bytes]:
    out = {}
    for entry in entries:
        fields = _decode(entry)
        out[fields[1][0].decode()] = fields.get(2, [b""])[0]
    return out


def _check_summary(request: bytes) -> dict[str, Any]:
    attributes = _decode(_decode(request)[1][0])  # CheckRequest.attributes
    http_request = _decode(_decode(attributes[4][0])[2][0])  # .request.http
    route_metadata: dict[str, dict[str, str]] = {}
    for entry in attributes.get(13, []):  # route_metadata_context
        for namespace, struct in _string_map(_decode(entry).get(1, [])).items():
            values = _string_map(_decode(struct).get(1, []))
            route_metadata[namespace] = {
                k: _decode(v)[3][0].decode() for k, v in values.items()
            }
    return {
        "path": http_request[4][0].decode(),
        "method": http_request[2][0].decode(),
        "host": http_request[5][0].decode(),
        "headers": {k: v.decode() for k, v in _string_map(http_request.get(3, [])).items()},
        "context_extensions": {
            k: v.decode() for k, v in _string_map(attributes.get(10, [])).items()
        },
        "route_metadata": route_metadata,
    }


class FakeExtAuthz:
    """Allows everything with tier ``gold``, RateLimit headers and a lease in metadata."""

    def __init__(self) -> None:
        self.checks: queue.Queue[tuple[dict[str, Any], dict[str, str]]] = queue.Queue()
        self.log_messages: queue.Queue[bytes] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "envoy.service.auth.v3.Authorization",
                    {"Check": grpc.unary_unary_rpc_method_handler(self._check)},
                ),
                grpc.method_handlers_generic_handler(
                    "envoy.service.accesslog.v3.AccessLogService",
                    {
                        "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                            self._logs
                        )
                    },
                ),
            ]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _check(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = {k: str(v) for k, v in context.invocation_metadata()}
        self.checks.put((_check_summary(request), metadata))
        return _ok_response(
            {"x-extauthz-tier": "gold"},
            {
                "RateLimit-Policy": "10;w=1",
                "RateLimit": "limit=10, remaining=9, reset=1",
            },
            {"lease": "lease-7f3a"},
        )

    def _logs(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for message in requests:
            self.log_messages.put(message)
        return b""  # StreamAccessLogsResponse is empty


@pytest.fixture
def fake_ext_authz() -> Iterator[FakeExtAuthz]:
    fake = FakeExtAuthz()
    yield fake
    fake.server.stop(grace=None)


def test_allowed_request_carries_tier_headers_and_metadata(
    upstream: Upstream, fake_ext_authz: FakeExtAuthz
) -> None:
    text = render(
        authz=("127.0.0.1", fake_ext_authz.port),
        upstream=("127.0.0.1", upstream.port),
    )
    with EnvoyProcess(text) as envoy:
        status, headers, body = http(envoy.url + "/v1/charges", method="POST")
        assert status == 200
        echo = json.loads(body)
        assert echo["tier"] == "gold"  # OkHttpResponse.headers reach the upstream
        assert "x-envoy-auth-failure-mode-allowed" not in echo["headers"]
        # OkHttpResponse.response_headers_to_add reach the client; no config needed.
        assert headers["ratelimit-policy"] == "10;w=1"
        assert headers["ratelimit"] == "limit=10, remaining=9, reset=1"

        check, grpc_metadata = fake_ext_authz.checks.get(timeout=1)
        assert check["path"] == "/v1/charges"
        assert check["route_metadata"] == {"extauthz": {"tier": "critical"}}
        assert check["context_extensions"] == {}
        assert grpc_metadata["traceparent"].startswith("00-")

        assert http(envoy.url + "/v1/ext/thing")[0] == 200
        check, _ = fake_ext_authz.checks.get(timeout=1)
        assert check["context_extensions"] == {"tier": "post"}
        assert check["route_metadata"] == {}

        assert http(envoy.url + "/healthz")[0] == 200
        # The access log stream: one entry per finished request, ext_authz metadata included.
        deadline = time.monotonic() + 5
        seen = b""
        while (seen.count(b"lease-7f3a") < 2 or b"/healthz" not in seen) and (
            time.monotonic() < deadline
        ):
            try:
                seen += fake_ext_authz.log_messages.get(timeout=0.1)
            except queue.Empty:
                pass
        assert seen.count(b"lease-7f3a") == 2
        assert b"envoy.filters.http.ext_authz" in seen
        assert b"/healthz" in seen
        assert fake_ext_authz.checks.empty()  # /healthz skipped ext_authz


_CLIENT_HEADERS = {"x-api-key": "sk_live_1", "Authorization": "Bearer t", "x-test-mode": "true",
                   "User-Agent": "probe/1", "x-unread": "noise", "x-extauthz-tier": "critical"}


def test_check_carries_only_the_allowed_headers(upstream: Upstream, fake_ext_authz: FakeExtAuthz) -> None:
    for send_all in (False, True):
        text = render(authz=("127.0.0.1", fake_ext_authz.port), upstream=("127.0.0.1", upstream.port),
                      send_all_headers=send_all)
        with EnvoyProcess(text) as envoy:
            status, _, body = http(envoy.url + "/v1/items?page=2", headers=_CLIENT_HEADERS)
        assert status == 200
        assert json.loads(body)["tier"] == "gold"  # the answer's tier, not the client's
        check, _ = fake_ext_authz.checks.get(timeout=1)
        # method, path and host travel in their own fields either way
        assert (check["method"], check["path"]) == ("GET", "/v1/items?page=2")
        assert check["host"].startswith("127.0.0.1:")
        sent = set(check["headers"])
        assert "x-extauthz-tier" not in sent  # stripped before the check
        if send_all:
            assert {"x-unread", "user-agent", "authorization", "x-api-key", ":path"} <= sent
        else:
            # exactly the list (Authorization too: the gRPC protocol adds nothing by itself)
            assert sent == {"authorization", "x-api-key", "x-test-mode", "x-request-id"}
            assert check["headers"]["authorization"] == "Bearer t"


@pytest.mark.parametrize("name", GRPC_CONFIGS)
def test_fail_open_strips_a_client_tier_header(name: str, upstream: Upstream, tmp_path: Path) -> None:
    options: dict[str, Any] = {}
    if "tls" in SHIPPED_OPTIONS[name]:  # envoy-tls.yaml: real files for Envoy to load
        from ..infra.certs import CA

        ca = CA()
        ca.write(tmp_path / "ca.crt")
        ca.issue("envoy").write(tmp_path, "tls")
        options["tls"] = TlsFiles(f"{tmp_path}/tls.crt", f"{tmp_path}/tls.key", f"{tmp_path}/ca.crt")
    text = render(name, authz=("127.0.0.1", free_port()), upstream=("127.0.0.1", upstream.port), **options)
    with EnvoyProcess(text) as envoy:
        status, _, body = http(envoy.url + "/v1/reports/daily",
                               headers={"x-api-key": "sk_live_1", "x-extauthz-tier": "critical",
                                        "x-extauthz-note": "kept"})
    assert status == 200
    echo = json.loads(body)
    assert echo["headers"]["x-envoy-auth-failure-mode-allowed"] == "true"
    assert echo["tier"] is None  # the client's x-extauthz-tier did not reach the upstream
    assert echo["headers"]["x-extauthz-note"] == "kept"  # other headers do


def test_benchmark_variant_local_ratelimit_with_direct_response() -> None:
    text = render(
        ext_authz=False,
        direct_response=True,
        local_ratelimit=LocalRateLimit(max_tokens=3, fill_interval="60s"),
    )
    with EnvoyProcess(text) as envoy:
        answers = [http(envoy.url + "/v1/anything") for _ in range(4)]
    assert [(status, body) for status, _, body in answers[:3]] == [(200, b"ok")] * 3
    status, headers, _ = answers[3]
    assert status == 429
    assert headers["x-ratelimit-limit"] == "3"


# ---- variants shipped beside envoy.yaml ---------------------------------------------------


def _filters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f.get("typed_config", {}) for f in _hcm(config)["http_filters"]}


def test_jwt_config_validates_with_jwt_authn_before_ext_authz() -> None:
    text = (REPO / "envoy" / "envoy-jwt.yaml").read_text(encoding="utf-8")
    validate(text)
    config = yaml.safe_load(text)
    names = [f["name"] for f in _hcm(config)["http_filters"]]
    assert names.index("envoy.filters.http.jwt_authn") < names.index(EXT_AUTHZ_FILTER)
    filters = _filters(config)
    provider = filters["envoy.filters.http.jwt_authn"]["providers"]["issuer"]
    assert provider["payload_in_metadata"] == "payload"
    requirements = filters["envoy.filters.http.jwt_authn"]["rules"][0]["requires"]["requires_any"]["requirements"]
    assert {"allow_missing": {}} in requirements
    ext_authz = filters[EXT_AUTHZ_FILTER]
    assert ext_authz["metadata_context_namespaces"] == ["envoy.filters.http.jwt_authn"]
    assert ext_authz["failure_mode_allow"] is True
    # renders like envoy.yaml (same clusters and listener)
    validate(render("envoy-jwt.yaml"))


def test_tls_config_validates_with_a_client_certificate(tmp_path: Path) -> None:
    from ..infra.certs import CA

    ca = CA()
    ca.write(tmp_path / "ca.crt")
    ca.issue("envoy").write(tmp_path, "tls")
    text = render("envoy-tls.yaml", tls=TlsFiles(f"{tmp_path}/tls.crt", f"{tmp_path}/tls.key", f"{tmp_path}/ca.crt"))
    validate(text)
    config = yaml.safe_load(text)
    socket_ = _cluster(config, "extauthz")["transport_socket"]
    assert socket_["name"] == "envoy.transport_sockets.tls"
    context = socket_["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext")
    common = context["common_tls_context"]
    assert common["tls_certificates"][0]["certificate_chain"] == {"filename": f"{tmp_path}/tls.crt"}
    assert common["validation_context"]["trusted_ca"] == {"filename": f"{tmp_path}/ca.crt"}
    # one cluster carries both the Check calls and the access-log stream: both are encrypted
    hcm = _hcm(config)
    assert _filters(config)[EXT_AUTHZ_FILTER]["grpc_service"]["envoy_grpc"]["cluster_name"] == "extauthz"
    logger = next(a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    assert logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "extauthz"
