"""What the harness can run: the table of configurations and the run options.

To add a configuration, add a row to ``SETUPS`` (and, if it belongs in a default run, its key
to ``DEFAULT_SETUPS``); ``RATIOS`` and ``P99_ADDED`` list the comparisons the report shows
besides each configuration's throughput relative to (a). A configuration is a stack:
Envoy (the generator's config for the policy, ``bench.stack.Running``), optionally the
extauthz server (policy from ``bench/policies``, ``server_args`` appended) and Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

POLICIES = Path(__file__).resolve().parent / "policies"


@dataclass(frozen=True)
class Setup:
    """One configuration: what runs behind Envoy, and how."""

    key: str
    label: str
    ext_authz: bool = True
    policy: str = "noop"
    redis: bool = False
    local_ratelimit: bool = False
    envoy_concurrency: int = 1
    workers: int = 1
    loop: str = "uvloop"
    #: Envoy's gRPC access log buffered (16 KiB or this many ms) instead of flushed per entry
    accesslog_flush_ms: float | None = None
    #: extra ``extauthz serve`` arguments
    server_args: tuple[str, ...] = ()
    #: Envoy's authorization protocol: "grpc", or "http" (the server also gets ``--http-listen``
    #: on a free port, and Envoy's ``extauthz_http`` cluster points at it), or "ratelimit"
    #: (Envoy's global rate limit filter calling ShouldRateLimit, ``envoy-config --protocol
    #: ratelimit``; its ``ratelimit.*`` stats stand for ext_authz's)
    protocol: str = "grpc"
    #: the load: "users" (wrk rotating 1,000 keys, h2load one key), or the flood mix (issue 16
    #: item 3): "flood" (one key, ``load.FLOOD_KEY``, sends every other request), "calm" (the
    #: same load without the flooding key: 1,000 other well-behaved keys in its place). Their
    #: paced run is two wrk processes at half the rate each, the well-behaved keys' latency
    #: read from the first alone (bench/load.py ``run_wrk_pair``); "hot": every request carries
    #: one key (``load.HOT_KEY``), saturated and paced alike (issue 29: a hot key's script calls
    #: serialise in Redis).
    load: str = "users"
    #: with ``workers`` > 1: ``--worker-ports`` (N ports, listed as N endpoints of Envoy's
    #: extauthz cluster) instead of one SO_REUSEPORT port
    worker_ports: bool = False
    #: gRPC only: no ext_authz ``allowed_headers`` (every request header in each CheckRequest)
    #: instead of the list the policy needs (``extauthz envoy-allowed-headers``)
    send_all_headers: bool = False
    #: Envoy's gRPC access log (the lease release path): "always" keeps the config file's,
    #: "auto" keeps it only when the policy holds a lease limiter, the rule of
    #: ``extauthz envoy-config --access-log auto`` (extauthz.envoy.config.holds_leases);
    #: "fluentd": Envoy's fluentd access logger to ``serve --fluentd-listen`` instead
    access_log: str = "always"
    #: issue 33: the policy's ``enforce: envoy`` limiters run in Envoy's rate limit quota filter
    #: (``extauthz envoy-config --rlqs``), which streams usage reports to the server's gRPC port;
    #: with ``ext_authz=False`` the server runs for that stream alone (no Check per request)
    rlqs: bool = False

    @property
    def server(self) -> bool:
        """Whether the extauthz server runs: for ext_authz, or for the quota stream alone."""
        return self.ext_authz or self.rlqs


SETUPS: dict[str, Setup] = {s.key: s for s in [
    Setup("a", "Envoy alone", ext_authz=False),
    # Issue 31 made the gRPC port on the event loop (--grpc-server asyncio) the default: (b),
    # (d) and (r) keep grpc.aio (--grpc-server grpcio) for the comparison with their -h2 rows;
    # the other gRPC rows run the default.
    Setup("b", "no-op ext_authz (ceiling), grpc.aio", policy="noop", server_args=("--grpc-server", "grpcio")),
    Setup("c", "4 limiters, embedded store", policy="all-on"),
    Setup("d", "4 limiters, Redis, grpc.aio", policy="all-on", redis=True, server_args=("--grpc-server", "grpcio")),
    Setup("e", "Envoy local_ratelimit", ext_authz=False, local_ratelimit=True),
    Setup("d1", "(d), Envoy x2 threads, 1 worker", policy="all-on", redis=True, envoy_concurrency=2),
    Setup("d2", "(d), Envoy x2 threads, --workers 2", policy="all-on", redis=True,
          envoy_concurrency=2, workers=2),
    Setup("b-aio", "(b) on asyncio (no uvloop)", policy="noop", loop="asyncio"),
    # Issue 31: the gRPC port served on the event loop (serve --grpc-server asyncio, the default).
    Setup("b-h2", "(b), --grpc-server asyncio", policy="noop", server_args=("--grpc-server", "asyncio")),
    Setup("d-h2", "(d), --grpc-server asyncio", policy="all-on", redis=True,
          server_args=("--grpc-server", "asyncio")),
    Setup("r-h2", "(r), --grpc-server asyncio, access log auto", policy="rate-only", redis=True,
          server_args=("--grpc-server", "asyncio"), access_log="auto"),
    Setup("d-aio", "(d) on asyncio (no uvloop)", policy="all-on", redis=True, loop="asyncio"),
    Setup("b-buf", "(b), access log buffered 5 ms", policy="noop", accesslog_flush_ms=5),
    Setup("d-buf", "(d), access log buffered 5 ms", policy="all-on", redis=True, accesslog_flush_ms=5),
    Setup("h", "no-op, HTTP protocol (ceiling)", policy="noop", protocol="http"),
    Setup("hc", "4 limiters, embedded, HTTP", policy="all-on", protocol="http"),
    Setup("hd", "4 limiters, Redis, HTTP", policy="all-on", redis=True, protocol="http"),
    # Issue 16 (r): one request_rate limiter on Redis, beside the Go peer's figures, on each
    # front door.
    Setup("r", "1 request_rate limiter, Redis, grpc.aio", policy="rate-only", redis=True,
          server_args=("--grpc-server", "grpcio")),
    # Issue 24: (rh) with the Envoy config its policy needs (no access log: it holds no lease);
    # (rhb) the same limiter with consistency: batched (bench/policies/rate-only-batched.yaml).
    Setup("rh", "1 request_rate limiter, Redis, HTTP", policy="rate-only", redis=True,
          protocol="http", access_log="auto"),
    Setup("rhb", "(rh), batched", policy="rate-only-batched", redis=True,
          protocol="http", access_log="auto"),
    # Issue 32 (rl): the peer table's shape itself: Envoy's ratelimit filter, one descriptor per
    # API key ([api_key]), the same limiter on Redis (bench/policies/rate-descriptor.yaml), the
    # default gRPC server: beside (r), (r-h2) and (rh).
    Setup("rl", "1 request_rate limiter, Redis, ratelimit filter", policy="rate-descriptor", redis=True,
          protocol="ratelimit"),
    # (hd) with request_rate and fleet_usage batched (all-on-batched.yaml).
    Setup("hdb", "(hd), rate + fleet batched", policy="all-on-batched", redis=True, protocol="http",
          access_log="auto"),
    # Issue 29: (hd) and (hdb) with one hot key (every request the same API key): the batched
    # four-limiter configuration against the exact one where grants matter most.
    Setup("hdk", "(hd), one hot key", policy="all-on", redis=True, protocol="http",
          load="hot"),
    Setup("hdbk", "(hdb), one hot key", policy="all-on-batched", redis=True, protocol="http",
          access_log="auto", load="hot"),
    # (hd) with the releases through Envoy's fluentd access logger (msgpack over TCP).
    Setup("hdf", "(hd), releases over fluentd", policy="all-on", redis=True, protocol="http",
          access_log="fluentd"),
    # Access-log batching by measurement: 20 ms vs the shipped 5 ms (d) and entry by entry (d-buf0).
    Setup("d-buf20", "(d), access log buffered 20 ms", policy="all-on", redis=True,
          accesslog_flush_ms=20),
    # Floods (issue 16 item 3): (d) with a rate of 10/s per key (bench/policies/flood.yaml);
    # one key sends half of all requests (f), or 1,000 other well-behaved keys do (fc).
    Setup("f", "(d) under a flood: 1 key sends half", policy="flood", redis=True, load="flood"),
    Setup("fc", "(f) without the flooding key", policy="flood", redis=True, load="calm"),
    # Several processes (issue 16 item 6): N ports as N endpoints, Envoy spreads the Checks.
    Setup("d2p", "(d), Envoy x2 threads, --workers 2 --worker-ports", policy="all-on", redis=True,
          envoy_concurrency=2, workers=2, worker_ports=True),
    # The shipped configs batch the access log every 5 ms (b, d, b-buf and d-buf alike now:
    # those two are kept for bench.accesslog_flush and --only, not run by default);
    # these send each entry at once, the previous shipped setting.
    Setup("b-buf0", "(b), access log entry by entry", policy="noop", accesslog_flush_ms=0),
    Setup("d-buf0", "(d), access log entry by entry", policy="all-on", redis=True, accesslog_flush_ms=0),
    # Envoy sends less (issue 16 item 4): the same without allowed_headers, every header sent.
    # Issue 33 (q): (r)'s rate-only shape enforced in Envoy: the quota filter holds a token
    # bucket per API key (1,000 buckets under wrk), no ext_authz; the server only divides the
    # limit over the quota stream, its ledger on Redis (q) or in the process (q-mem)
    Setup("q", "1 request_rate limiter in Envoy (RLQS), Redis", ext_authz=False, rlqs=True,
          policy="rate-envoy", redis=True),
    Setup("q-mem", "(q), embedded store", ext_authz=False, rlqs=True, policy="rate-envoy"),
    Setup("b-all", "(b), every header to the server", policy="noop", send_all_headers=True),
    Setup("r-all", "(r), every header to the server", policy="rate-only", redis=True,
          send_all_headers=True),
]}
DEFAULT_SETUPS = ("a", "b", "c", "d", "e", "d1", "d2", "d2p", "b-aio", "d-aio", "h", "hc", "hd", "hdb", "hdf", "b-h2",
                  "r-h2", "d-h2", "r", "rh", "rhb", "rl", "q", "q-mem", "b-all", "r-all", "d-buf20", "f", "fc",
                  "b-buf0", "d-buf0")
SMOKE_SETUPS = ("a", "b", "c")

#: Throughput ratios ``<k>/<base>`` reported besides every ``<k>/a`` (report order).
RATIOS: tuple[tuple[str, str], ...] = (
    ("c", "b"), ("d", "b"), ("d2", "d1"), ("d2p", "d1"), ("d2p", "d2"), ("b-aio", "b"), ("d-aio", "d"),
    ("b", "b-all"), ("r", "r-all"), ("h", "b"), ("hc", "c"), ("hd", "d"), ("hc", "h"), ("hd", "h"),
    ("d-buf20", "d"), ("r", "b"), ("rh", "h"), ("rh", "a"), ("rhb", "h"), ("rhb", "rh"), ("hdb", "h"),
    ("hdb", "hd"), ("hdbk", "hdk"), ("hdf", "hd"), ("f", "c"), ("fc", "c"), ("f", "fc"),
    ("b", "b-buf0"), ("d", "d-buf0"),
)
#: ``cpu <k>/<base>``: server CPU per check of k over base, per round.
CPU_RATIOS: tuple[tuple[str, str], ...] = (("h", "b"), ("hc", "c"), ("hd", "d"), ("rh", "r"), ("rhb", "rh"),
                                           ("hdb", "hd"), ("hdbk", "hdk"), ("hdf", "hd"))
#: ``p99 added <k>/<base>``: (p99(k) - p99(a)) / (p99(base) - p99(a)) at the paced rate.
P99_ADDED: tuple[tuple[str, str], ...] = (("d", "b"), ("c", "b"))
#: ``p99 <k>/<base>``: p99(k) / p99(base) at the paced rate (the flood: well-behaved keys).
P99_RATIOS: tuple[tuple[str, str], ...] = (("f", "fc"),)
#: issue 31's targets: the gRPC port served on the event loop against grpc.aio and the HTTP door
CPU_RATIOS += (("b-h2", "b"), ("b-h2", "h"), ("d-h2", "d"), ("r-h2", "rh"), ("r-h2", "b-h2"))
RATIOS += (("b-h2", "b"), ("d-h2", "b-h2"), ("r-h2", "b-h2"), ("b-h2", "h"))
#: issue 32's target: ShouldRateLimit against a rate-only Check on the same door (r-h2)
CPU_RATIOS += (("rl", "r-h2"), ("rl", "r"))
RATIOS += (("rl", "r-h2"), ("rl", "r"), ("rl", "rh"))
#: issue 33's targets: a rate-only policy enforced in Envoy against Envoy alone (a), and beside
#: Envoy's local rate limit (e); ``envoy cpu <k>/<base>``: Envoy's CPU per request of k over base
RATIOS += (("q", "e"), ("q", "q-mem"), ("q", "rl"))
ENVOY_CPU_RATIOS: tuple[tuple[str, str], ...] = (("q", "a"), ("q-mem", "a"), ("e", "a"))


def policy_file(setup: Setup) -> Path:
    return POLICIES / f"{setup.policy}.yaml"


@dataclass
class Options:
    setups: tuple[str, ...] = DEFAULT_SETUPS
    rounds: int = 3
    duration: float = 10.0      # seconds of each measured load run
    warmup: float = 2.0
    connections: int = 32       # wrk
    threads: int = 1            # wrk
    rate: int = 1000            # h2load paced run, requests/s in total
    rate_clients: int = 2
    deadline_ms: float = 5.0
    #: the benchmark Redis's nice value (0: as every other process on the machine)
    redis_nice: int = 0
    outage: tuple[str, ...] = ("kill", "pause")
    outage_duration: float = 10.0
    limits_compare: bool = True
    smoke: bool = False
    json_path: Path | None = None
    docs: bool = True
    plot: bool = True
    report_from: Path | None = None
