"""``extauthz demo --pictures DIR``: Stripe's four pictures, through the real stack.

One stack (the tiny upstream, the server on the embedded store, a real Envoy with the
shipped config) runs a policy with one limiter per picture, each scoped to its own path
prefix, and four traffic scenarios one after the other. Each picture draws the limit it is
about and the quantity that limiter counts, measured, not modelled:

1. request rate: the tokens left in each user's bucket, read from the ``RateLimit`` header
   of every answer, against the burst;
2. concurrency: requests in flight per user at the upstream (the tiny upstream notes when it
   began and answered each request, by an ``x-demo-seq`` header), against the limit;
3. fleet usage: the fleet's in-flight requests by tier (the same upstream view), against the
   capacity and the part reserved for critical traffic;
4. worker utilization: the shedder's utilization and its shed level (polled from the admin
   port's ``/status``) on separate axes, with the tier bands, and what each tier was refused.

Under each, requests per second by user or tier and outcome. Every picture's data is written
beside it as CSV (``NAME.csv``: one row per request; ``4-worker-utilization-shedder.csv``:
the polled shedder), and tests/simulate/test_pictures_data.py checks each caption's claim
from it.

``time_scale`` stretches or shrinks every duration (traffic phases, slow requests, the
worker shedder's controller constants): 1.0 takes about a minute, the CI smoke test
runs at 0.3 (request rates and the token bucket's rate scale with 1 / time_scale).
"""

from __future__ import annotations

import bisect
import csv
import json
import re
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devtools.client import HttpClient
from .devtools.stack import Stack
from .devtools.upstream import SEQ_HEADER, Upstream

POLICY = """\
version: 1
identity: [{{header: x-api-key}}]
test_mode: {{key_prefix: sk_test_}}
classification:
  rules:
    - match: {{methods: [POST], path_prefix: /fleet/critical}}
      tier: critical
    - match: {{methods: [POST], path_prefix: /workers/critical}}
      tier: critical
limiters:
  - name: user-rate                  # picture 1: a token bucket per user
    type: request_rate
    rate: {rate}
    burst: 20
    applies_to: {{path_prefix: /rate/}}
  - name: user-concurrency           # picture 2: requests in flight per user
    type: concurrent_requests
    limit: 4
    applies_to: {{path_prefix: /conc/}}
  - name: fleet                      # picture 3: the fleet's capacity, 25 % kept for critical
    type: fleet_usage
    capacity: 16
    reserved_for_critical: 0.25
    applies_to: {{path_prefix: /fleet/}}
  - name: workers                    # picture 4: worker utilization, short controller constants
    type: worker_utilization
    signal: {{source: inflight, capacity: 10}}   # reads the fleet limiter's in-flight leases
    applies_to: {{path_prefix: /workers/}}
    sample_interval: {sample}
    good_below: 0.5
    bad_above: 0.6
    delay_before_shedding: {delay}
    time_to_shed_all: {shed_all}
"""


@dataclass
class Flow:
    """Requests from one traffic source: ``threads`` senders between ``start`` and ``stop``
    (seconds into the scenario); open loop at ``rate`` per second per thread, or closed
    loop (the next request when the last answered, after ``pause`` if it was refused).
    ``user`` is who the limiter counts (``key`` with ``{k}`` for one key per thread), ``tier``
    what the policy classifies the requests as."""

    label: str
    path: str
    key: str
    user: str
    tier: str = "get"
    method: str = "GET"
    threads: int = 1
    rate: float | None = None
    start: float = 0.0
    stop: float = 1.0
    pause: float = 0.05
    #: seconds between starting one thread and the next (a ramp)
    stagger: float = 0.0


@dataclass
class Sent:
    """One request as the client saw it (times in seconds from the scenario's start)."""

    flow: str
    user: str
    tier: str
    sent: float
    answered: float
    status: int
    #: the ``RateLimit`` header's remaining tokens for the request-rate limiter, if any
    tokens_left: float | None = None
    #: when the upstream began and answered it (allowed requests only)
    upstream: tuple[float, float] | None = None


CSV_FIELDS = ("flow", "user", "tier", "sent", "answered", "status", "tokens_left", "upstream_start",
              "upstream_end")
SHEDDER_FIELDS = ("time", "level", "utilization", "p_test", "p_get", "p_post", "p_critical")


@dataclass
class Scenario:
    name: str
    caption: str
    duration: float
    flows: list[Flow]
    results: list[Sent] = field(default_factory=list)
    #: (time, level, utilization, {tier: drop probability}) polled from /status (picture 4)
    shedder: list[tuple[float, float, float, dict[str, float]]] = field(default_factory=list)

    def table(self) -> str:
        rows = ["| flow | sent | 200 | 429 | 503 |", "|---|---:|---:|---:|---:|"]
        counts: dict[str, Counter[int]] = {}
        for r in self.results:
            counts.setdefault(r.flow, Counter())[r.status] += 1
        for flow in self.flows:
            c = counts.get(flow.label, Counter())
            rows.append(f"| {flow.label} | {sum(c.values())} | {c[200]} | {c[429]} | {c[503]} |")
        return "\n".join(rows)

    def write_csv(self, out: Path) -> list[Path]:
        path = out / f"{self.name}.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CSV_FIELDS)
            for r in sorted(self.results, key=lambda r: r.sent):
                up = r.upstream
                w.writerow([r.flow, r.user, r.tier, f"{r.sent:.4f}", f"{r.answered:.4f}", r.status,
                            "" if r.tokens_left is None else f"{r.tokens_left:g}",
                            "" if up is None else f"{up[0]:.4f}", "" if up is None else f"{up[1]:.4f}"])
        paths = [path]
        if self.shedder:
            path = out / f"{self.name}-shedder.csv"
            with path.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(SHEDDER_FIELDS)
                for t, level, util, p in self.shedder:
                    w.writerow([f"{t:.4f}", f"{level:.4f}", f"{util:.4f}",
                                *(f"{p.get(tier, 0.0):.4f}" for tier in ("test", "get", "post", "critical"))])
            paths.append(path)
        return paths


def scenarios(scale: float) -> list[Scenario]:
    s = scale
    slow = f"?delay={0.5 * s:.3f}"
    return [
        Scenario(
            "1-request-rate",
            "Request rate: alice bursts far above her rate and her bucket empties, so she gets 429s; "
            "bob and carol stay under their rate and always pass.",
            6 * s, [
                Flow("alice", "/rate/v1/customers", "sk_live_alice", "alice", rate=10 / s, stop=6 * s),
                Flow("alice burst", "/rate/v1/customers", "sk_live_alice", "alice", threads=4, rate=25 / s,
                     start=2 * s, stop=4 * s),
                Flow("bob", "/rate/v1/customers", "sk_live_bob", "bob", rate=12 / s, stop=6 * s),
                Flow("carol", "/rate/v1/customers", "sk_live_carol", "carol", rate=5 / s, stop=6 * s),
            ]),
        Scenario(
            "2-concurrency",
            "Concurrency: dave keeps 10 slow requests going; at most 4 are ever in flight, the rest "
            "get 429; erin's 2 always pass.",
            5 * s, [
                Flow("dave", "/conc/v1/slow" + slow, "sk_live_dave", "dave", threads=10, stop=5 * s,
                     pause=0.1 * s, stagger=0.2 * s),
                Flow("erin", "/conc/v1/slow" + slow, "sk_live_erin", "erin", threads=2, stop=5 * s),
            ]),
        Scenario(
            "3-fleet-usage",
            "Fleet usage: non-critical traffic ramps up to the 12 of 16 slots it may use and the "
            "rest gets 503; critical traffic uses the reserved 4 and always passes.",
            6 * s, [
                Flow("non-critical GET", "/fleet/v1/items" + slow, "sk_live_many_{k}", "many (one key a thread)",
                     threads=20, stop=6 * s, pause=0.1 * s, stagger=0.15 * s),
                Flow("critical POST", "/fleet/critical" + slow, "sk_live_pay", "pay", tier="critical",
                     method="POST", threads=3, stop=6 * s),
            ]),
        Scenario(
            "4-worker-utilization",
            "Worker utilization: while slow requests keep the workers busy the shed level rises and "
            "test traffic is shed first, then GET, then POST, critical never; it comes back gradually.",
            13 * s, [
                Flow("test", "/workers/v1/items", "sk_test_t", "t", tier="test", rate=20 / s, stop=13 * s),
                Flow("get", "/workers/v1/items", "sk_live_g", "g", rate=20 / s, stop=13 * s),
                Flow("post", "/workers/v1/items", "sk_live_p", "p", tier="post", method="POST", rate=20 / s,
                     stop=13 * s),
                Flow("critical", "/workers/critical", "sk_live_c", "c", tier="critical", method="POST",
                     rate=20 / s, stop=13 * s),
                # The shedder's inflight signal counts the fleet limiter's leases (policy above):
                # slow critical requests there keep the "workers" busy, never refused themselves.
                Flow("busy workers (critical, slow)", "/fleet/critical" + slow, "sk_live_busy", "busy",
                     tier="critical", method="POST", threads=10, start=1.5 * s, stop=7 * s),
            ]),
    ]


_TOKENS = re.compile(r'"user-rate";r=(\d+)')


def _status(admin: str, client: HttpClient) -> dict[str, Any]:
    result = client.send(f"{admin}/status")
    data: dict[str, Any] = json.loads(result.body)
    return data


def run_scenario(url: str, client: HttpClient, sc: Scenario, upstream: Upstream | None = None,
                 admin: str | None = None, poll: float = 0.1) -> None:
    """Send the scenario's traffic. Every sender thread has its own connection (HttpClient
    keeps one a thread), so slow or refused flows never hold up another flow's requests."""
    t0 = time.monotonic() + 0.05
    lock = threading.Lock()
    seqs: dict[str, int] = {}
    done = threading.Event()

    def sender(flow: Flow, k: int) -> None:
        begin = t0 + flow.start + k * flow.stagger
        delay = begin - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        n = 0
        key = flow.key.format(k=k)
        while True:
            now = time.monotonic()
            if now >= t0 + flow.stop:
                return
            seq = f"{sc.name}-{flow.label}-{k}-{n}"
            result = client.send(url + flow.path, flow.method, {"x-api-key": key, SEQ_HEADER: seq})
            answered = time.monotonic()
            m = _TOKENS.search(result.headers.get("ratelimit", ""))
            with lock:
                seqs[seq] = len(sc.results)
                sc.results.append(Sent(flow.label, flow.user, flow.tier, now - t0, answered - t0,
                                       result.status, float(m.group(1)) if m else None))
            n += 1
            if flow.rate is not None:
                wait = begin + n / flow.rate - time.monotonic()
            else:
                wait = flow.pause if result.status != 200 else 0.0
            if wait > 0:
                time.sleep(wait)

    def poller() -> None:
        assert admin is not None
        with HttpClient() as own:
            while not done.wait(poll):
                for shed in _status(admin, own).get("shedding", []):
                    sc.shedder.append((time.monotonic() - t0, float(shed["level"]),
                                       float(shed["utilization"] or 0.0), dict(shed["probabilities"])))

    threads = [threading.Thread(target=sender, args=(flow, k), daemon=True)
               for flow in sc.flows for k in range(flow.threads)]
    watcher = threading.Thread(target=poller, daemon=True) if admin is not None else None
    if watcher is not None:
        watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    if watcher is not None:
        watcher.join()
    if upstream is not None:
        for seq, i in seqs.items():
            held = upstream.held.pop(seq, None)
            if held is not None:
                sc.results[i].upstream = (held[0] - t0, held[1] - t0)


def in_flight(intervals: Iterable[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """A step function (times, counts) of how many intervals are open: each count holds
    from its time to the next. An interval ending when another begins is closed first."""
    spans = list(intervals)
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    ts, ns, n = [0.0], [0], 0
    for t, d in events:
        n += d
        ts.append(t)
        ns.append(n)
    return ts, ns


def _rates(results: Iterable[Sent], width: float, bins: int, key: Any) -> dict[Any, list[float]]:
    """Requests per second in bins of ``width`` by send time, by ``key(result)``."""
    series: dict[Any, list[float]] = {}
    for r in results:
        i = int(r.sent / width)
        if 0 <= i < bins:
            series.setdefault(key(r), [0.0] * bins)[i] += 1 / width
    return series


#: per outcome: a line style and a word
OUTCOMES = {200: ("-", "allowed"), 429: ("--", "429"), 503: (":", "503")}


def plot(sc: Scenario, out: Path, scale: float) -> Path:
    from .simulate.report import TIER_COLORS, legend_outside, require_matplotlib

    plt = require_matplotlib()
    width = 0.5 * scale
    bins = max(1, int(sc.duration / width) + 1)
    xs = [(i + 0.5) * width for i in range(bins)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    users = list(dict.fromkeys(f.user for f in sc.flows))
    color_of = {u: colors[i % len(colors)] for i, u in enumerate(users)}
    if sc.name.startswith("4-"):
        fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True, height_ratios=[1, 1, 1.4])
    else:
        fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[1.3, 1])
    top = axes[0]
    rate_ax = axes[-1]

    if sc.name.startswith("1-"):
        burst = 20
        for u in users:
            tokens = sorted((r.answered, r.tokens_left) for r in sc.results
                            if r.user == u and r.tokens_left is not None)
            top.step([t for t, _ in tokens], [v for _, v in tokens], where="post", color=color_of[u],
                     linewidth=2.2 if u == "alice" else 1.4, label=f"{u}: tokens left")
        top.axhline(burst, color="black", linestyle="--", linewidth=1, label=f"burst (bucket size) {burst}")
        top.axhline(0, color="#d62728", linestyle="-", linewidth=1, label="empty: requests get 429")
        top.set(ylabel="tokens left", ylim=(-1, burst + 2),
                title="user-rate limiter: tokens left in each user's bucket (from the RateLimit header)")
    elif sc.name.startswith("2-"):
        limit = 4
        for u in users:
            ts, ns = in_flight(r.upstream for r in sc.results if r.user == u and r.upstream is not None)
            top.step(ts, ns, where="post", color=color_of[u], linewidth=1.8, label=f"{u}: in flight")
        top.axhline(limit, color="#d62728", linestyle="--", linewidth=1.2, label=f"limit per user: {limit}")
        top.set(ylabel="requests in flight", ylim=(-0.2, limit + 2),
                title="user-concurrency limiter: each user's requests in flight at the upstream")
    elif sc.name.startswith("3-"):
        capacity, ceiling = 16, 12
        grid = [i * sc.duration / 600 for i in range(601)]
        stacks = []
        for tier in ("get", "critical"):
            ts, ns = in_flight(r.upstream for r in sc.results if r.tier == tier and r.upstream is not None)
            stacks.append([ns[bisect.bisect_right(ts, g) - 1] for g in grid])
        top.stackplot(grid, stacks, colors=[TIER_COLORS["get"], TIER_COLORS["critical"]], alpha=0.75,
                      labels=["non-critical in flight", "critical in flight (on top)"], step="post")
        top.axhspan(ceiling, capacity, color=TIER_COLORS["critical"], alpha=0.08,
                    label=f"reserved for critical ({capacity - ceiling} slots)")
        top.axhline(ceiling, color=TIER_COLORS["get"], linestyle="--", linewidth=1.2,
                    label=f"non-critical may use {ceiling}")
        top.axhline(capacity, color="black", linestyle="-", linewidth=1.2, label=f"capacity {capacity}")
        top.set(ylabel="requests in flight", ylim=(0, capacity + 3),
                title="fleet limiter: the fleet's requests in flight by tier (stacked), at the upstream")
    else:
        pts = sc.shedder
        times = [t for t, _, _, _ in pts]
        top.plot(times, [u for _, _, u, _ in pts], color="black", linewidth=1.6, label="utilization")
        top.axhline(0.6, color="#d62728", linestyle="--", linewidth=1, label="bad above 0.6: level rises")
        top.axhline(0.5, color="#2ca02c", linestyle="--", linewidth=1, label="good below 0.5: level falls")
        top.set(ylabel="utilization", ylim=(-0.05, 1.1),
                title="workers shedder: utilization (its input), its shed level, and who is refused")
        mid = axes[1]
        for y, tier in ((0.0, "test"), (1 / 3, "get"), (2 / 3, "post")):
            mid.axhspan(y, y + 1 / 3, color=TIER_COLORS[tier], alpha=0.12,
                        label=f"above {y:.2f}: {tier} shed too")
        mid.plot(times, [lv for _, lv, _, _ in pts], color="black", linewidth=1.6, label="shed level")
        mid.axhline(0, color="grey", linewidth=0.6)
        mid.set(ylabel="shed level", ylim=(min([-0.1, *(lv for _, lv, _, _ in pts)]) - 0.05, 1.05))
        legend_outside(mid)

    if sc.name.startswith("4-"):
        # refused per tier; where tiers are refused alike the lines coincide, so each has its
        # own style, marker and width (the widest drawn first) and all stay visible
        series = _rates((r for r in sc.results if not r.flow.startswith("busy")), width, bins,
                        lambda r: (r.tier, r.status == 200))
        for tier, style, marker, lw in (("test", ":", "o", 4.0), ("get", "--", "s", 2.8),
                                        ("post", "-.", "^", 1.6), ("critical", "-", "D", 1.2)):
            ys = series.get((tier, False), [0.0] * bins)
            rate_ax.plot(xs, ys, style, color=TIER_COLORS[tier], linewidth=lw, marker=marker, markersize=4,
                         label=f"{tier}: refused (503)")
        sent = _rates((r for r in sc.results if r.flow == "critical"), width, bins, lambda r: r.status == 200)
        rate_ax.plot(xs, sent.get(True, [0.0] * bins), "-", color=TIER_COLORS["critical"], linewidth=0.8,
                     alpha=0.5, label="critical: allowed")
        rate_ax.set(ylabel="requests / s refused, by tier")
    else:
        series = _rates(sc.results, width, bins, lambda r: (r.user, r.status))
        for u in users:
            for status, (style, word) in OUTCOMES.items():
                found = series.get((u, status))
                if found is not None:
                    rate_ax.plot(xs, found, style, color=color_of[u] if not sc.name.startswith("3-") else
                                 TIER_COLORS["critical" if u == "pay" else "get"],
                                 linewidth=1.8, marker="o" if status != 200 else None, markersize=3,
                                 label=f"{u}: {word}")
        rate_ax.set(ylabel="requests / s (sent, by outcome)")
    rate_ax.set(xlabel="seconds")
    legend_outside(top)
    legend_outside(rate_ax)
    fig.suptitle(textwrap.fill(sc.caption, 110), fontsize=10)
    fig.tight_layout()
    path = out / f"{sc.name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(out: str | Path, time_scale: float = 1.0, only: Sequence[str] = ()) -> int:
    from .simulate.report import require_matplotlib

    try:
        require_matplotlib("--pictures", "demo,tune")
    except ImportError as exc:
        print(f"extauthz demo: {exc}", file=sys.stderr)
        return 2
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    s = time_scale
    policies = Path(tempfile.mkdtemp(prefix="extauthz-pictures-"))
    (policies / "pictures.yaml").write_text(POLICY.format(
        rate=f"{20 / s:.3f}", sample=f"{0.1 * s:.3f}s", delay=f"{1.0 * s:.3f}s", shed_all=f"{3.0 * s:.3f}s"))
    todo = [sc for sc in scenarios(s) if not only or sc.name in only]
    # The fleet scenario fills the fleet's leases, which the worker shedder reads as its
    # utilization signal: run it last so the worker picture starts from a rested shedder.
    todo.sort(key=lambda sc: sc.name.startswith("3-"))
    print(f"Starting the stack (Envoy, extauthz, upstream); {len(todo)} scenarios, "
          f"time scale {s:g} ...")
    md = ["# The four pictures", "",
          f"Made by `extauthz demo --pictures` (time scale {s:g}) through a real Envoy, the "
          "server on the embedded store and the tiny upstream. Policy:", "", "```yaml",
          (policies / "pictures.yaml").read_text().rstrip(), "```", ""]
    with Stack([policies]) as stack, HttpClient() as client:
        assert stack.server is not None
        admin = f"http://127.0.0.1:{stack.server.admin_port}"
        for sc in todo:
            run_scenario(stack.url, client, sc, stack.upstream,
                         admin if sc.name.startswith("4-") else None, poll=0.1 * s)
            path = plot(sc, out, s)
            written = sc.write_csv(out)
            print(f"\n{path}: {sc.caption}\n{sc.table()}\ndata: {', '.join(str(d) for d in written)}")
    for sc in sorted(todo, key=lambda sc: sc.name):
        names = [f"{sc.name}.csv"] + ([f"{sc.name}-shedder.csv"] if sc.shedder else [])
        md += [f"## {sc.name}", "", f"![{sc.caption}]({sc.name}.png)", "", sc.caption, "", sc.table(), "",
               "Data: " + ", ".join(f"[{n}]({n})" for n in names) + ".", ""]
    (out / "pictures.md").write_text("\n".join(md))
    return 0
