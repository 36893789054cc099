"""The measured record of one load run (``Phase``) and the statistics over rounds: medians,
per-round ratios, percentiles, and the targets of issue 7."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .configs import CPU_RATIOS, ENVOY_CPU_RATIOS, P99_ADDED, P99_RATIOS, RATIOS, SETUPS, Setup

#: the Go peer (envoyproxy/ratelimit on Redis) in the peer table's shape, as a share of Envoy
#: alone measured with it (docs/benchmarks.md, "The bar: the Go peer": 6,706 req/s, 0.167x):
#: measured elsewhere, so issue 33's "3x the peer's requests per second" is read on ratios to (a)
PEER_OVER_ENVOY_ALONE = 0.167


@dataclass
class Phase:
    """One measured load run against one configuration."""

    setup: str
    kind: str  # "saturated" | "latency"
    round: int
    requests: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    non_2xx: int = 0
    errors: int = 0
    ext_authz_ok: int | None = None
    ext_authz_failure_mode_allowed: int | None = None
    ext_authz_error: int | None = None
    ext_authz_denied: int | None = None
    local_ratelimit_ok: int | None = None
    fail_open: dict[str, int] = field(default_factory=dict)
    #: checks the server decided while starved (``/status`` ``overload.checks``, all tiers):
    #: its shedders refused the non-critical ones (docs/limiters.md, "A starved server")
    overload_checks: int = 0
    server_cpu_us: float | None = None     # per request
    envoy_cpu_us: float | None = None
    redis_cpu_us: float | None = None
    #: Redis ``INFO commandstats`` calls per request over the run, by command (``evalsha``,
    #: ``time``, ``get``...; the harness's own ``info`` left out); empty without Redis
    redis_commands: dict[str, float] = field(default_factory=dict)
    #: the server's store round trips and script calls per request (``/metrics``:
    #: ``extauthz_store_round_trips_total``, ``extauthz_store_script_calls_total``)
    store_round_trips: float | None = None
    store_script_calls: float | None = None
    #: passed store deadlines by where the check was (``extauthz_store_deadline_missed_total``:
    #: queued, redis, loop) over the run
    deadline_missed: dict[str, int] = field(default_factory=dict)
    worker_connections: list[int] = field(default_factory=list)
    worker_cpu_share: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: the flood configurations (``Setup.load``): requests/s of the second load (the flooding
    #: key's, or the well-behaved keys' in its place) and, for the flooding key, that rate
    #: over its limit (the policy's ``rate``); in the paced run the latency figures above are
    #: the first load's, the well-behaved keys' alone
    flood_rps: float | None = None
    flood_factor: float | None = None
    #: the quota rows (``Setup.rlqs``, issue 33; bench/stack.py ``fill_quota``): Envoy's
    #: refusals in the run (its 429s), the quota stream's reports and bucket entries (every
    #: report carries each of its Envoy's buckets), the buckets held at the end, the server's
    #: CPU per entry, what Envoy reported allowed and denied, over-admission and the store
    #: ledger's failed calls over the run
    refused: int | None = None
    quota_reports: int | None = None
    quota_entries: int | None = None
    quota_buckets: int | None = None
    server_cpu_us_per_entry: float | None = None
    quota_allowed: int | None = None
    quota_denied: int | None = None
    quota_overadmission: int | None = None
    quota_ledger_failures: int | None = None

    @property
    def consulted(self) -> bool:
        return bool(self.ext_authz_ok)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def latency_summary(rows: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    ms = [d / 1000.0 for _, _, d in rows]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "p999_ms": percentile(ms, 99.9)}


def med(values: Sequence[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def by(phases: Sequence[Phase], setup: str, kind: str) -> list[Phase]:
    return [p for p in phases if p.setup == setup and p.kind == kind]


def round_ratio(phases: Sequence[Phase], fn: Callable[[dict[str, Phase]], float | None]) -> list[float]:
    """``fn`` on each round's phases (keyed ``setup/kind``); the rounds where it is defined."""
    out = []
    for r in sorted({p.round for p in phases}):
        table = {f"{p.setup}/{p.kind}": p for p in phases if p.round == r}
        try:
            value = fn(table)
        except (KeyError, ZeroDivisionError, TypeError):
            value = None
        if value is not None:
            out.append(value)
    return out


def redis_calls(phases: Sequence[Phase]) -> dict[str, Any]:
    """Per request, medians over the runs: Redis commands (total and by command) and the
    store's round trips and script calls."""
    names = sorted({c for p in phases for c in p.redis_commands})
    by_command = {c: med([p.redis_commands.get(c, 0.0) for p in phases if p.redis_commands]) for c in names}
    return {
        "commands": med([sum(p.redis_commands.values()) for p in phases if p.redis_commands]),
        "by_command": dict(sorted(by_command.items(), key=lambda kv: -(kv[1] or 0.0))),
        "round_trips": med([p.store_round_trips for p in phases]),
        "script_calls": med([p.store_script_calls for p in phases]),
    }


def summarize(setups: Sequence[Setup], phases: Sequence[Phase]) -> dict[str, Any]:
    """Per configuration (in ``setups`` order) the medians over rounds; the ratios."""
    rows = []
    for setup in setups:
        sat, lat = by(phases, setup.key, "saturated"), by(phases, setup.key, "latency")
        rows.append({
            "key": setup.key, "label": setup.label,
            "rps": med([p.rps for p in sat]), "rps_all": [round(p.rps) for p in sat],
            "p50_ms": med([p.p50_ms for p in lat]), "p99_ms": med([p.p99_ms for p in lat]),
            "p999_ms": med([p.p999_ms for p in lat]),
            "rate": med([p.rps for p in lat]),
            "server_cpu_us": med([p.server_cpu_us for p in sat]),
            "envoy_cpu_us": med([p.envoy_cpu_us for p in sat]),
            "redis_cpu_us": med([p.redis_cpu_us for p in sat]),
            "consulted": all(p.consulted for p in sat + lat) if setup.ext_authz else None,
            "ext_authz_ok": sum(p.ext_authz_ok or 0 for p in sat + lat) if setup.ext_authz else None,
            "failure_mode_allowed": sum(p.ext_authz_failure_mode_allowed or 0 for p in sat + lat)
            if setup.ext_authz else None,
            "fail_open": _sum_dicts([p.fail_open for p in sat + lat]),
            "fail_open_saturated": _sum_dicts([p.fail_open for p in sat]),
            "fail_open_latency": _sum_dicts([p.fail_open for p in lat]),
            "deadline_missed": _sum_dicts([p.deadline_missed for p in sat + lat]),
            "requests": sum(p.requests for p in sat + lat),
            "requests_saturated": sum(p.requests for p in sat),
            "cores": {
                "server": med([(p.server_cpu_us or 0) * p.rps / 1e6 for p in sat]) if setup.server else None,
                "envoy": med([(p.envoy_cpu_us or 0) * p.rps / 1e6 for p in sat]),
                "redis": med([(p.redis_cpu_us or 0) * p.rps / 1e6 for p in sat]) if setup.redis else None,
            },
            "problems": sorted({x for p in sat + lat for x in p.problems if "failed open" not in x}),
            "worker_cpu_share": [p.worker_cpu_share for p in sat if p.worker_cpu_share],
            "flood_factor": med([p.flood_factor for p in sat]),
            "flood_factor_latency": med([p.flood_factor for p in lat]),
            "refused_share": med([p.non_2xx / p.requests for p in sat if p.requests])
            if setup.load != "users" or setup.rlqs else None,
            "quota": {
                "refused": sum(p.refused or 0 for p in sat + lat),
                "reports": med([p.quota_reports for p in sat]),
                "entries": med([p.quota_entries for p in sat]),
                "buckets": med([p.quota_buckets for p in sat]),
                "server_cpu_us_per_entry": med([p.server_cpu_us_per_entry for p in sat]),
                "allowed": sum(p.quota_allowed or 0 for p in sat + lat),
                "denied": sum(p.quota_denied or 0 for p in sat + lat),
                "overadmission": sum(p.quota_overadmission or 0 for p in sat + lat),
                "ledger_failures": sum(p.quota_ledger_failures or 0 for p in sat + lat),
            } if setup.rlqs else None,
            "redis_calls": {"saturated": redis_calls(sat), "latency": redis_calls(lat)} if setup.redis else None,
        })

    def thr(t: dict[str, Phase], k: str) -> float:
        return t[f"{k}/saturated"].rps

    def p99(t: dict[str, Phase], k: str) -> float:
        v = t[f"{k}/latency"].p99_ms
        assert v is not None
        return v

    ratios: dict[str, list[float]] = {}
    keys = {setup.key for setup in setups}
    if "a" in keys:
        for k in SETUPS:
            if k != "a" and k in keys:
                ratios[f"{k}/a"] = round_ratio(phases, _ratio_fn(thr, k, "a"))
    for k, base in RATIOS:
        if {k, base} <= keys:
            ratios[f"{k}/{base}"] = round_ratio(phases, _ratio_fn(thr, k, base))
    for k, base in P99_ADDED:
        if {"a", k, base} <= keys:
            ratios[f"p99 added {k}/{base}"] = round_ratio(phases, _p99_added_fn(p99, k, base))
    for k, base in P99_RATIOS:
        if {k, base} <= keys:
            ratios[f"p99 {k}/{base}"] = round_ratio(phases, _ratio_fn(p99, k, base))
    for k, base in CPU_RATIOS:
        if {k, base} <= keys:
            ratios[f"cpu {k}/{base}"] = round_ratio(phases, _cpu_ratio_fn(k, base))
    for k, base in ENVOY_CPU_RATIOS:
        if {k, base} <= keys:
            ratios[f"envoy cpu {k}/{base}"] = round_ratio(phases, _envoy_cpu_ratio_fn(k, base))
    return {
        "rows": rows,
        "ratios": {k: {"median": med(v), "rounds": [round(x, 3) for x in v]} for k, v in ratios.items()},
    }


def _ratio_fn(thr: Callable[[dict[str, Phase], str], float], k: str,
              base: str) -> Callable[[dict[str, Phase]], float | None]:
    return lambda t: thr(t, k) / thr(t, base)


def _cpu_ratio_fn(k: str, base: str) -> Callable[[dict[str, Phase]], float | None]:
    """Server CPU per check of ``k`` over ``base`` in one round (None when either is unknown)."""
    def fn(t: dict[str, Phase]) -> float | None:
        a, b = t[f"{k}/saturated"].server_cpu_us, t[f"{base}/saturated"].server_cpu_us
        return a / b if a and b else None
    return fn


def _envoy_cpu_ratio_fn(k: str, base: str) -> Callable[[dict[str, Phase]], float | None]:
    """Envoy's CPU per request of ``k`` over ``base`` in one round (saturated runs)."""
    def fn(t: dict[str, Phase]) -> float | None:
        a, b = t[f"{k}/saturated"].envoy_cpu_us, t[f"{base}/saturated"].envoy_cpu_us
        return a / b if a and b else None
    return fn


def _p99_added_fn(p99: Callable[[dict[str, Phase], str], float], k: str,
                  base: str) -> Callable[[dict[str, Phase]], float | None]:
    return lambda t: (p99(t, k) - p99(t, "a")) / (p99(t, base) - p99(t, "a"))


def _sum_dicts(items: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in items:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def targets(summary: dict[str, Any], *, limits: dict[str, Any] | None, outages: Sequence[dict[str, Any]],
            deadline_ms: float) -> list[dict[str, Any]]:
    """The goals of issue 7, each with its measured value (only those the run measured)."""
    ratios = summary["ratios"]
    out = []

    def add(name: str, value: float | None, goal: float, higher: bool = True, unit: str = "x") -> None:
        if value is None:
            return
        ok = value >= goal if higher else value <= goal
        out.append({"target": name, "value": round(value, 3), "goal": goal, "met": ok,
                    "unit": unit, "higher": higher})

    # issue 24
    rows = {row["key"]: row for row in summary["rows"]}

    def row_value(key: str, name: str) -> float | None:
        return (rows.get(key) or {}).get(name)

    def script_calls(key: str) -> float | None:
        return (((rows.get(key) or {}).get("redis_calls") or {}).get("saturated") or {}).get("script_calls")

    add("(rh) server CPU per check (us)", row_value("rh", "server_cpu_us"), 80, higher=False, unit="us")
    add("(rh) throughput / (a)", (ratios.get("rh/a") or {}).get("median"), 0.2)
    add("(rhb) server CPU per check (us)", row_value("rhb", "server_cpu_us"), 60, higher=False, unit="us")
    add("(rhb) store script calls per request", script_calls("rhb"), 0.05, higher=False, unit="")
    add("(rhb) throughput / (h)", (ratios.get("rhb/h") or {}).get("median"), 0.85)
    add("(hd) throughput / (h), issue 24", (ratios.get("hd/h") or {}).get("median"), 0.6)
    add("(hdb) throughput / (h)", (ratios.get("hdb/h") or {}).get("median"), 0.8)
    add("(d) throughput / (b), issue 24", (ratios.get("d/b") or {}).get("median"), 0.6)
    shares = {k: row["fail_open_saturated"].get("timeout", 0) / row["requests_saturated"] * 100
              for k, row in rows.items() if row.get("requests_saturated") and row.get("consulted") is not None}
    if shares:
        worst = max(shares, key=lambda k: shares[k])
        add(f"timeout fail-opens, worst saturated configuration ({worst}), % of checks", shares[worst],
            0.01, higher=False, unit="%")
    # issue 29: batched never worse than exact (four limiters, HTTP; rotating keys and one hot key)
    for batched, exact in (("hdb", "hd"), ("hdbk", "hdk")):
        add(f"({batched}) throughput / ({exact}), issue 29",
            (ratios.get(f"{batched}/{exact}") or {}).get("median"), 1.0)
        if (row := rows.get(batched)) and row.get("requests"):
            store = sum(n for reason, n in row["fail_open"].items() if reason in ("timeout", "circuit_open",
                                                                                   "unavailable"))
            add(f"({batched}) store fail-opens, % of checks", store / row["requests"] * 100, 0.01,
                higher=False, unit="%")
            add(f"({batched}) circuit_open fail-opens (breaker closed: 0)", row["fail_open"].get("circuit_open", 0),
                0, higher=False, unit="")
    add("(d) throughput / (b)", (ratios.get("d/b") or {}).get("median"), 0.8)
    add("(c) throughput / (b)", (ratios.get("c/b") or {}).get("median"), 0.9)
    add("(hd) throughput / (h)", (ratios.get("hd/h") or {}).get("median"), 0.8)
    add("(hc) throughput / (c)", (ratios.get("hc/c") or {}).get("median"), 4.0)
    add("(hc) server CPU per check / (c)", (ratios.get("cpu hc/c") or {}).get("median"), 0.25, higher=False)
    add("(d) 2 workers / 1 worker (Envoy x2)", (ratios.get("d2/d1") or {}).get("median"), 1.5)
    add("p99 added by (d) / p99 added by (b), at 1,000 req/s",
        (ratios.get("p99 added d/b") or {}).get("median"), 1.3, higher=False)
    add("Flood: (f) throughput / (c)", (ratios.get("f/c") or {}).get("median"), 1.0)
    add("Flood: well-behaved keys' p99 at 1,000 req/s, (f) / (fc)",
        (ratios.get("p99 f/fc") or {}).get("median"), 1.2, higher=False)
    # issue 31: the gRPC port on the event loop against the HTTP door and its own ceiling;
    # issue 32: ShouldRateLimit against a rate-only Check on that door
    add("(b-h2) server CPU per check / (h), issue 31", (ratios.get("cpu b-h2/h") or {}).get("median"), 1.3,
        higher=False)
    add("(r-h2) server CPU per check / (rh), issue 31", (ratios.get("cpu r-h2/rh") or {}).get("median"), 1.2,
        higher=False)
    add("(r-h2) throughput / (b-h2), issue 31", (ratios.get("r-h2/b-h2") or {}).get("median"), 0.7)
    add("(d-h2) throughput / (b-h2), issue 31", (ratios.get("d-h2/b-h2") or {}).get("median"), 0.6)
    add("(rl) server CPU per ShouldRateLimit / (r-h2)'s per Check, issue 32",
        (ratios.get("cpu rl/r-h2") or {}).get("median"), 1.2, higher=False)
    # issue 33: a rate-only policy enforced in Envoy (its quota filter) against Envoy alone, and
    # the Go peer's requests per second read as its share of Envoy alone (PEER_OVER_ENVOY_ALONE)
    for k in ("q", "q-mem"):
        add(f"({k}) Envoy CPU per request / (a)", (ratios.get(f"envoy cpu {k}/a") or {}).get("median"), 1.3,
            higher=False)
        thr = (ratios.get(f"{k}/a") or {}).get("median")
        add(f"({k}) throughput / (a)", thr, 0.6)
        add(f"({k}) throughput / the Go peer's (as shares of Envoy alone)",
            None if thr is None else thr / PEER_OVER_ENVOY_ALONE, 3.0)
        if (quota := (rows.get(k) or {}).get("quota")) is not None:
            add(f"({k}) quota over-admission", quota["overadmission"], 0, higher=False, unit="")
    if limits:
        add("Redis store checks/s / limits hits/s", limits.get("ratio"), 2.0)
    for o in outages:
        sat, lat = o.get("saturated"), o.get("latency")
        if sat:
            add(f"Redis {o['mode']}: throughput down / up", sat["down_rps"] / sat["up_rps"], 0.9)
        if lat:
            # issue 16: "p99 grows by no more than the store deadline after the first second"
            # (the first second is the breaker's window: it opens once half its calls failed)
            add(f"Redis {o['mode']}: p99 growth at 1,000 req/s after the first second (ms, <= deadline)",
                lat["down_steady"]["p99_ms"] - lat["up"]["p99_ms"], deadline_ms, higher=False, unit="ms")
    return out
