"""A real Envoy with its global rate limit filter (``envoy.filters.http.ratelimit``) calling
ShouldRateLimit on the server's gRPC port: descriptors from request headers, the remote
address and generic keys; domain mismatch; unknown descriptors (allowed, counted); shadow
mode; the server or its Redis down (fail open within the filter's timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from extauthz.core.clock import ManualClock
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import free_port
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.envoy.ratelimit import render
from extauthz.policy import load_policy
from extauthz.proto import auth_pb2, auth_pb2_grpc, status_pb2
from extauthz.server.app import Server, ServerConfig
from testinfra.redis_servers import RedisSingle

from ..conftest import FIXTURES, ROOT
from ..infra.certs import CA

pytestmark = pytest.mark.e2e

POLICY = """\
version: 1
limiters:
  - name: per-key
    type: quota
    limit: 2
    period: hour
    match: {domain: edge, descriptor: [{key: api_key}]}
  - name: search-per-key
    type: quota
    limit: 1
    period: hour
    match: {domain: edge, descriptor: [{key: generic_key, value: search}, {key: api_key}]}
  - name: shadow-user
    type: quota
    limit: 1
    period: hour
    mode: shadow
    match: {domain: edge, descriptor: [{key: user}]}
"""
#: the limiters' clock, frozen half a second into an hour (and a minute): a window that ended
#: between two requests of a test (the wall clock crossing a minute or an hour) would count anew
START = 1_800_000_000.5
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
#: the filter's timeout: a check slower than this is failed open by Envoy
TIMEOUT = 0.25


def envoy_config(rls_port: int, upstream_port: int, domain: str = "edge", tls: Path | None = None) -> str:
    limits = [
        {"actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]},
        {"actions": [{"remote_address": {}}]},  # no limiter has it: unknown, allowed
        {"actions": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}]},
    ]
    search = [{"generic_key": {"descriptor_value": "search"}},
              {"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "ingress_http",
        "route_config": {"name": "local", "virtual_hosts": [{
            "name": "api", "domains": ["*"], "rate_limits": limits,
            "routes": [
                {"match": {"prefix": "/search"}, "route": {"cluster": "upstream", "rate_limits": [
                    *limits, {"actions": search}]}},
                {"match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
            ]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ratelimit", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                "domain": domain, "failure_mode_deny": False, "timeout": f"{TIMEOUT}s",
                "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "extauthz"}},
                                       "transport_api_version": "V3"}}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }

    def cluster(name: str, port: int, h2: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": name, "type": "STATIC", "connect_timeout": "0.25s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
        if h2 and tls is not None:  # mTLS to the server: Envoy's certificate, the server's checked
            out["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": "extauthz",
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [{"certificate_chain": {"filename": str(tls / "envoy" / "tls.crt")},
                                          "private_key": {"filename": str(tls / "envoy" / "tls.key")}}],
                    "validation_context": {"trusted_ca": {"filename": str(tls / "ca.crt")}}}}}
        if h2:
            out["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
        return out

    return yaml.safe_dump({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{"name": "ingress", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [cluster("extauthz", rls_port, True), cluster("upstream", upstream_port, False)],
        },
    })


def get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with _OPENER.open(request, timeout=5) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with start_upstream("127.0.0.1") as server:
        yield server


@pytest.fixture(params=["grpcio", "asyncio"])
async def server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=request.param),
                 clock=ManualClock(START))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=0)


async def statuses(envoy: EnvoyProcess, path: str, n: int, **headers: str) -> list[int]:
    return [(await asyncio.to_thread(get, envoy.url + path, headers))[0] for _ in range(n)]


async def test_descriptors_from_headers_generic_keys_and_unknown_ones(server: Server, upstream: Upstream) -> None:
    with EnvoyProcess(envoy_config(server.port, upstream.port)) as envoy:
        assert server.ratelimit is not None
        door = server.ratelimit.door
        assert await statuses(envoy, "/a", 3, **{"x-api-key": "k1"}) == [200, 200, 429]
        assert await statuses(envoy, "/a", 1, **{"x-api-key": "k2"}) == [200]  # a counter per value
        _, headers = await asyncio.to_thread(get, envoy.url + "/a", {"x-api-key": "k1"})
        assert headers["x-envoy-ratelimited"] == "true"
        assert headers["ratelimit"].startswith('"per-key";r=0') and headers["retry-after"]
        # /search: the generic key's descriptor beside the per-key one (both must allow)
        assert await statuses(envoy, "/search", 2, **{"x-api-key": "k3"}) == [200, 429]
        # each descriptor counts on its own, as envoyproxy/ratelimit's do: the refused /search
        # still took one of per-key's 2
        assert await statuses(envoy, "/a", 1, **{"x-api-key": "k3"}) == [429]
        # every request also sent the remote address, which no limiter matches: allowed, counted
        assert door.unknown == 8
        # shadow: counted, never refused
        assert await statuses(envoy, "/a", 3, **{"x-user": "u1"}) == [200, 200, 200]


async def test_domain_mismatch_allows_everything(server: Server, upstream: Upstream) -> None:
    with EnvoyProcess(envoy_config(server.port, upstream.port, domain="other")) as envoy:
        assert await statuses(envoy, "/a", 4, **{"x-api-key": "k1"}) == [200] * 4
        assert server.ratelimit is not None and server.ratelimit.door.decided == 0


def test_server_down_fails_open(upstream: Upstream) -> None:
    with EnvoyProcess(envoy_config(free_port(), upstream.port)) as envoy:
        started = time.monotonic()
        assert [get(envoy.url + "/a", {"x-api-key": "k1"})[0] for _ in range(3)] == [200] * 3
        assert time.monotonic() - started < 3 * (TIMEOUT + 1.0)


@pytest.mark.parametrize("redis", ["refused", pytest.param("stalled", marks=pytest.mark.redis)])
async def test_redis_down_fails_open_within_the_deadline(redis: str, upstream: Upstream, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    """A Redis that refuses connections, or one that accepts and never answers (paused): each
    descriptor is failed open by the server within the filter's timeout, and counted."""
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    stalled: RedisSingle | None = request.getfixturevalue("redis_single_clean") if redis == "stalled" else None
    url = stalled.url if stalled is not None else f"redis://127.0.0.1:{free_port()}"
    srv = Server(ServerConfig(policies=[str(policy)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server="asyncio", redis_url=url))
    await srv.start()
    try:
        with EnvoyProcess(envoy_config(srv.port, upstream.port)) as envoy:
            if stalled is not None:
                stalled.pause()
            try:
                for _ in range(3):
                    status, headers = await asyncio.to_thread(get, envoy.url + "/a", {"x-api-key": "k1"})
                    assert status == 200 and "x-envoy-ratelimited" not in headers
            finally:
                if stalled is not None:
                    stalled.resume()
            stats = envoy.stats(r"ratelimit")
            # decided by the server (failed open there, counted), not timed out in Envoy
            assert not any(v for k, v in stats.items() if k.endswith("ratelimit.error")), stats
        assert srv.ratelimit is not None and srv.ratelimit.door.decided == 3
        # one failure counted per descriptor (a breaker that opened counts circuit_open)
        failures = srv.engine.failures
        assert sum(failures.values()) == 3 and failures.get("timeout" if stalled else "unavailable"), failures
    finally:
        await srv.stop(grace=0)


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_over_mtls(grpc_server: str, upstream: Upstream, tmp_path: Path) -> None:
    ca = CA()
    ca.write(tmp_path / "ca.crt")
    ca.issue("extauthz", dns=("extauthz",), ips=("127.0.0.1",)).write(tmp_path / "server", "tls")
    ca.issue("envoy").write(tmp_path / "envoy", "tls")
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    srv = Server(ServerConfig(policies=[str(policy)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=grpc_server,
                              tls_cert=str(tmp_path / "server" / "tls.crt"),
                              tls_key=str(tmp_path / "server" / "tls.key"),
                              tls_client_ca=str(tmp_path / "ca.crt")), clock=ManualClock(START))
    await srv.start()
    try:
        with EnvoyProcess(envoy_config(srv.port, upstream.port, tls=tmp_path)) as envoy:
            assert await statuses(envoy, "/a", 3, **{"x-api-key": "k1"}) == [200, 200, 429]
        assert srv.ratelimit is not None and srv.ratelimit.door.decided == 3
    finally:
        await srv.stop(grace=0)


async def test_the_shipped_config_and_policy(upstream: Upstream) -> None:
    """envoy/envoy-ratelimit.yaml's generator (on free ports) with policies/ratelimit/."""
    policies = ROOT / "policies" / "ratelimit"
    srv = Server(ServerConfig(policies=[str(policies)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server="asyncio"), clock=ManualClock(START))
    await srv.start()
    try:
        text = render(load_policy([policies]), upstream=("127.0.0.1", upstream.port), authz=("127.0.0.1", srv.port),
                      headers={"api_key": "x-api-key", "plan": "x-plan"}, listen_port=0, admin_port=0)
        with EnvoyProcess(text) as envoy:
            free = {"x-api-key": "k1", "x-plan": "free"}
            assert await statuses(envoy, "/a", 11, **free) == [200] * 10 + [429]  # free-per-key: 10 a minute
            assert await statuses(envoy, "/a", 2, **{"x-api-key": "k1", "x-plan": "pro"}) == [200, 200]
            # every request sent five descriptors (key, plan+key, address, the generic key, the
            # route's tier: post); the pro plan's plan+key reaches no limiter
            door = srv.ratelimit.door if srv.ratelimit is not None else None
            assert door is not None and (door.decided, door.unknown) == (11 * 5 + 2 * 4, 2)
    finally:
        await srv.stop(grace=0)


@pytest.mark.parametrize("options", [{}, {"ext_authz": ("127.0.0.1", 9000)}, {"tls": "files"}],
                         ids=["plain", "with-ext-authz", "mtls"])
def test_generated_variants_pass_envoy_validation(options: dict[str, Any], tmp_path: Path) -> None:
    from extauthz.envoy.blocks import TlsFiles
    from testinfra.envoy_configs import validate

    if options.get("tls"):
        ca = CA()
        ca.write(tmp_path / "ca.crt")
        ca.issue("envoy").write(tmp_path, "tls")
        options = {"tls": TlsFiles(f"{tmp_path}/tls.crt", f"{tmp_path}/tls.key", f"{tmp_path}/ca.crt")}
    validate(render(load_policy([ROOT / "policies" / "ratelimit"]), upstream=("127.0.0.1", 8080),
                    headers={"api_key": "x-api-key"}, **options))


TIERED = """\
version: 1
limiters:
  - name: per-key
    type: quota
    limit: 100
    period: hour
    match: {domain: edge, descriptor: [{key: api_key}]}
  - name: workers
    type: worker_utilization
    signal: {source: redis}
    sample_interval: 3600
    match: {domain: edge, descriptor: [{key: tier}]}
"""


BUDGET_MS = 5000.0


@contextlib.asynccontextmanager
async def generated(policy: Path, grpc_server: str, upstream: Upstream
                    ) -> AsyncIterator[tuple[Server, dict[str, Any], dict[str, Any]]]:
    """A server on ``policy`` with a long check budget (a stall of this shared machine must
    not make the server starved: then a shedder refuses every non-critical descriptor at
    once, extauthz/engine/overload.py), the config ``envoy-config --protocol ratelimit``
    generates for it, and that config's connection manager."""
    srv = Server(ServerConfig(policies=[str(policy)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              reload_interval=0, identity_salt="s", grpc_server=grpc_server,
                              check_budget_ms=BUDGET_MS))
    await srv.start()
    try:
        config = yaml.safe_load(render(load_policy([policy]), upstream=("127.0.0.1", upstream.port),
                                       authz=("127.0.0.1", srv.port), headers={"api_key": "x-api-key"},
                                       listen_port=0, admin_port=0, check_budget_ms=BUDGET_MS))
        yield srv, config, config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]
    finally:
        await srv.stop(grace=0)


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_worker_utilization_sheds_by_the_routes_tier(grpc_server: str, upstream: Upstream,
                                                           tmp_path: Path) -> None:
    """The generated config's metadata action sends each route's tier (its metadata, where
    Check's classifier reads it; ``post`` when it names none); the shedder sheds by it."""
    policy = tmp_path / "p.yaml"
    policy.write_text(TIERED)
    async with generated(policy, grpc_server, upstream) as (srv, config, hcm):
        vhost = hcm["route_config"]["virtual_hosts"][0]
        assert {"metadata": {"descriptor_key": "tier", "source": "ROUTE_ENTRY", "default_value": "post",
                             "metadata_key": {"key": "extauthz", "path": [{"key": "tier"}]}}} in [
            a for limit in vhost["rate_limits"] for a in limit["actions"]]
        vhost["routes"].insert(0, {"match": {"prefix": "/admin"}, "route": {"cluster": "upstream"},
                                   "metadata": {"filter_metadata": {"extauthz": {"tier": "critical"}}}})
        vhost["routes"].insert(1, {"match": {"prefix": "/search"}, "route": {"cluster": "upstream"},
                                   "metadata": {"filter_metadata": {"extauthz": {"tier": "get"}}}})
        (worker,) = srv.engine.snapshot.workers
        with EnvoyProcess(yaml.safe_dump(config)) as envoy:
            key = {"x-api-key": "k1"}
            assert [s for p in ("/a", "/search", "/admin") for s in await statuses(envoy, p, 2, **key)] == [200] * 6
            worker.set_level(1.0)  # shed all it may: everything but critical
            assert await statuses(envoy, "/a", 2, **key) == [429, 429]
            assert await statuses(envoy, "/search", 2, **key) == [429, 429]
            assert await statuses(envoy, "/admin", 2, **key) == [200, 200]
            worker.set_level(0.0)
            assert await statuses(envoy, "/a", 1, **key) == [200]
        door = srv.ratelimit.door if srv.ratelimit is not None else None
        # every request: its key's descriptor and its tier's
        assert door is not None and (door.decided, door.unknown) == (2 * 13, 0)
        assert srv.lag.overloaded == {}


#: the lease limiters (shared with tests/integration/test_ratelimit_leases.py)
LEASED = FIXTURES / "policies" / "ratelimit_leases.yaml"


@pytest.mark.parametrize("grpc_server", ["grpcio", "asyncio"])
async def test_leases_travel_in_the_answer_and_the_access_log_releases_them(
        grpc_server: str, upstream: Upstream) -> None:
    """concurrent_requests and fleet_usage over ShouldRateLimit: the descriptors' leases, under
    one lease id, in the response's dynamic metadata; the generated config's access log hands
    them back when the request finishes (the ratelimit filter's namespace)."""
    async with generated(LEASED, grpc_server, upstream) as (srv, config, hcm):
        assert [log["name"] for log in hcm["access_log"]] == ["envoy.access_loggers.http_grpc"]
        releaser = srv.engine.releaser
        with EnvoyProcess(yaml.safe_dump(config)) as envoy:
            # one request in flight for k1 (the upstream holds it): a second one for k1 is
            # refused (the filter answers 429), k2 is not
            door = srv.ratelimit.door if srv.ratelimit is not None else None
            assert door is not None
            slow = asyncio.create_task(asyncio.to_thread(get, envoy.url + "/slow?delay=2", {"x-api-key": "k1"}))
            for _ in range(100):  # bounded: until the slow request's lease descriptors were decided
                if door.decided >= 2:
                    break
                await asyncio.sleep(0.02)
            assert await statuses(envoy, "/a", 1, **{"x-api-key": "k1"}) == [429]
            assert await statuses(envoy, "/a", 1, **{"x-api-key": "k2"}) == [200]
            assert (await slow)[0] == 200
            for _ in range(100):  # bounded: until the access log released the slow one's leases
                if (await statuses(envoy, "/a", 1, **{"x-api-key": "k1"})) == [200]:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the access log never released k1's lease")
            for _ in range(100):  # bounded: until the last one's entry came back too
                if releaser.counts[("access_log", "released")] >= 3:
                    break
                await asyncio.sleep(0.05)
        # every admitted request's leases (a concurrency slot and a fleet slot each) came back
        # through the access log; the refused ones' at once (nothing went on)
        assert releaser.counts[("access_log", "released")] >= 3
        assert releaser.counts[("cancelled_check", "released")] >= 1  # the refused ones
        assert not any(srv.accesslog.finished.rejected.values())  # every ticket held
        fleet = next(lim for lim, _ in srv.engine.snapshot.active if lim.name == "fleet")
        assert list(await srv.engine.store.inflight((fleet.critical_key, fleet.other_key))) == [0, 0]


SHAPES = """\
version: 1
ratelimit_headers:
  style: counts
  names: {limit: X-RateLimit-Limit, remaining: X-RateLimit-Remaining, reset: X-RateLimit-Reset}
limiters:
  - name: per-client
    type: quota
    limit: 1
    period: hour
    match: {domain: shapes, descriptor: [{key: client_id}]}
  - name: premium
    type: quota
    limit: 3
    period: hour
    match: {domain: shapes, descriptor: [{key: client_id, value: premium}]}
    detailed_metric: true
  - name: bulk
    type: quota
    limit: 2
    period: hour
    match: {domain: shapes, descriptor: [{key: generic_key, value: bulk}, {key: client_id}]}
    replaces: [per-client]
  - name: heavy
    type: quota
    limit: 3
    period: hour
    match: {domain: shapes, descriptor: [{key: generic_key, value: heavy}, {key: client_id}]}
  - name: shadow-user
    type: quota
    limit: 1
    period: hour
    mode: shadow
    match: {domain: shapes, descriptor: [{key: user}]}
unlimited:
  - match: {domain: shapes, descriptor: [{key: client_id, value: internal}]}
"""


def shapes_config(rls_port: int, upstream_port: int) -> str:
    """:func:`envoy_config` with the shapes' routes: ``/`` sends the client's and the user's
    descriptors, ``/bulk`` the client's and a bulk one (which replaces the client's limit),
    ``/heavy`` a heavy one that adds 2 hits (a ``hits_addend``: Envoy 1.40 sends it from a
    ``RateLimitPerRoute``'s rate limits, and ignores it on a route's own ``rate_limits``)."""
    config = yaml.safe_load(envoy_config(rls_port, upstream_port, domain="shapes"))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    client = {"request_headers": {"header_name": "x-client", "descriptor_key": "client_id"}}
    user = {"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}
    hcm["route_config"]["virtual_hosts"][0] = {
        "name": "api", "domains": ["*"], "rate_limits": [{"actions": [client]}, {"actions": [user]}],
        "routes": [
            {"match": {"prefix": "/bulk"}, "route": {"cluster": "upstream", "rate_limits": [
                {"actions": [client]}, {"actions": [{"generic_key": {"descriptor_value": "bulk"}}, client]}]}},
            {"match": {"prefix": "/heavy"}, "route": {"cluster": "upstream"}, "typed_per_filter_config": {
                "envoy.filters.http.ratelimit": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                    "rate_limits": [{"actions": [{"generic_key": {"descriptor_value": "heavy"}}, client],
                                     "hits_addend": {"number": 2}}]}}},
            {"match": {"prefix": "/"}, "route": {"cluster": "upstream"}},
        ]}
    return yaml.safe_dump(config)


async def test_every_descriptor_shape_and_the_peers_count_headers(upstream: Upstream, tmp_path: Path) -> None:
    """Through the filter: a value's own limit over its key's default, ``unlimited``,
    ``replaces``, ``detailed_metric``, a rate limit's ``hits_addend``, shadow mode counted as would-refuse, and the
    ``counts`` headers (envoyproxy/ratelimit's ``LIMIT_RESPONSE_HEADERS_ENABLED``) on the
    answers Envoy gives, allowed and refused."""
    policy = tmp_path / "p.yaml"
    policy.write_text(SHAPES)
    srv = Server(ServerConfig(policies=[str(policy)], listen=f"127.0.0.1:{free_port()}", admin_listen="off",
                              metrics_listen="127.0.0.1:0", reload_interval=0, identity_salt="s",
                              grpc_server="asyncio", check_budget_ms=BUDGET_MS), clock=ManualClock(START))
    await srv.start()
    try:
        with EnvoyProcess(shapes_config(srv.port, upstream.port)) as envoy:
            async def answers(path: str, n: int, **headers: str) -> list[tuple[int, dict[str, str]]]:
                return [await asyncio.to_thread(get, envoy.url + path, headers) for _ in range(n)]

            def counts(answer: tuple[int, dict[str, str]]) -> tuple[str, str] | None:
                _, h = answer
                if "x-ratelimit-limit" not in h:
                    return None
                assert h["x-ratelimit-reset"] == "3600"  # the hour's window ends in 3599.5 s
                return h["x-ratelimit-limit"], h["x-ratelimit-remaining"]

            # a key's default: one an hour per client
            first, second = await answers("/", 2, **{"x-client": "c1"})
            assert (first[0], second[0]) == (200, 429)
            assert (counts(first), counts(second)) == (("1", "0"), ("1", "0"))
            # a value of its own wins over its key's default
            premium = await answers("/", 4, **{"x-client": "premium"})
            assert [a[0] for a in premium] == [200, 200, 200, 429]
            assert [counts(a) for a in premium] == [("3", "2"), ("3", "1"), ("3", "0"), ("3", "0")]
            # detailed_metric: counted per value under a label that is not the value
            detailed = srv.ratelimit.door.detailed if srv.ratelimit is not None else {}
            assert sorted((code, n) for (_, _, code), n in detailed.items()) == [("ok", 3), ("over_limit", 1)]
            assert {(name, value != "premium") for name, value, _ in detailed} == {("premium", True)}
            # unlimited: never counted, no limit to tell
            internal = await answers("/", 5, **{"x-client": "internal"})
            assert [(a[0], counts(a)) for a in internal] == [(200, None)] * 5
            # /bulk: the bulk limit (2) replaces the client's (1) in the same request; the
            # client's limit was not counted there
            assert [a[0] for a in await answers("/bulk", 3, **{"x-client": "c2"})] == [200, 200, 429]
            assert [a[0] for a in await answers("/", 2, **{"x-client": "c2"})] == [200, 429]
            # /heavy: 2 hits a request against 3
            heavy = await answers("/heavy", 2, **{"x-client": "c3"})
            assert [(a[0], counts(a)) for a in heavy] == [(200, ("3", "1")), (429, ("3", "1"))]
            # shadow: never refused, its would-refusals counted
            assert [a[0] for a in await answers("/", 3, **{"x-user": "u1"})] == [200] * 3
        metrics = srv.observe.metrics
        assert metrics is not None
        assert metrics.registry.get_sample_value("extauthz_limiter_decisions_total", {
            "limiter": "shadow-user", "outcome": "shadow_denied"}) == 2
    finally:
        await srv.stop(grace=0)


class TeamAuth(auth_pb2_grpc.AuthorizationServicer):
    """A team's own auth service in the ext_authz slot: a key starting ``valid-`` passes."""

    def __init__(self) -> None:
        self.calls = 0

    async def Check(self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext) -> auth_pb2.CheckResponse:
        self.calls += 1
        valid = request.attributes.request.http.headers.get("x-api-key", "").startswith("valid-")
        code = 0 if valid else grpc.StatusCode.PERMISSION_DENIED.value[0]
        return auth_pb2.CheckResponse(status=status_pb2.Status(code=code))


async def test_the_teams_auth_service_in_ext_authz_and_extauthz_for_limits(server: Server, upstream: Upstream) -> None:
    """``envoy-config --protocol ratelimit --ext-authz``: the team's auth service decides first
    (a refusal never reaches the rate limit filter), extauthz limits what it lets through."""
    team = TeamAuth()
    auth = grpc.aio.server()
    auth_pb2_grpc.add_AuthorizationServicer_to_server(team, auth)
    port = auth.add_insecure_port("127.0.0.1:0")
    await auth.start()
    try:
        text = render(server.engine.snapshot.policy, upstream=("127.0.0.1", upstream.port),
                      authz=("127.0.0.1", server.port), ext_authz=("127.0.0.1", port),
                      headers={"api_key": "x-api-key"}, listen_port=0, admin_port=0)
        with EnvoyProcess(text) as envoy:
            assert server.ratelimit is not None
            door = server.ratelimit.door
            assert await statuses(envoy, "/a", 2, **{"x-api-key": "stolen"}) == [403, 403]
            assert (team.calls, door.decided) == (2, 0)  # refused before the rate limit filter
            # the generated config sends every shape the policy counts on every route: the key's
            # (per-key: 2 an hour) and the search one's (1 an hour)
            assert await statuses(envoy, "/a", 3, **{"x-api-key": "valid-1"}) == [200, 429, 429]
            assert (team.calls, door.decided) == (5, 3 * 2)
    finally:
        await auth.stop(grace=0)


async def test_fleet_usage_keeps_its_reserve_for_critical_routes(upstream: Upstream) -> None:
    """fleet_usage over ShouldRateLimit by the route's tier (the metadata action): with the
    slots other tiers may hold in flight, a post route is refused and a critical one admitted."""
    async with generated(LEASED, "asyncio", upstream) as (srv, config, hcm):
        hcm["route_config"]["virtual_hosts"][0]["routes"].insert(0, {
            "match": {"prefix": "/admin"}, "route": {"cluster": "upstream"},
            "metadata": {"filter_metadata": {"extauthz": {"tier": "critical"}}}})
        fleet = next(lim for lim, _ in srv.engine.snapshot.active if lim.name == "fleet")
        with EnvoyProcess(yaml.safe_dump(config)) as envoy:
            # capacity 4, half reserved for critical: two post requests in flight fill the rest
            slow = [asyncio.create_task(asyncio.to_thread(get, envoy.url + "/slow?delay=1", {"x-api-key": k}))
                    for k in ("k1", "k2")]
            for _ in range(100):  # bounded: until both hold their fleet slot
                if list(await srv.engine.store.inflight((fleet.critical_key, fleet.other_key))) == [0, 2]:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the slow requests never held their fleet slots")
            assert await statuses(envoy, "/a", 1, **{"x-api-key": "k3"}) == [429]
            assert await statuses(envoy, "/admin", 1, **{"x-api-key": "k4"}) == [200]
            assert [(await s)[0] for s in slow] == [200, 200]
