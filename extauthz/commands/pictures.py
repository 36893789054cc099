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
the polled shedder). After drawing, the demo checks each caption's claims against that data
(:data:`CAPTION_CHECKS`, the same checks tests/simulate/test_pictures_data.py runs on the
committed pictures) and says whether each holds; it exits 1 when one does not.

A request Envoy let through without a decision (the ext_authz check outlasted Envoy's
timeout and ``failure_mode_allow`` passed it: the upstream sees Envoy's fail-open header) is
marked ``unchecked`` in the data, counted in the tables, and drawn apart in the fleet
picture: no limiter counted it, so it can push the fleet past its cap.

``time_scale`` stretches or shrinks every duration (traffic phases, slow requests, the
worker shedder's controller constants): 1.0 takes about a minute, the CI smoke test
runs at 0.3 (request rates and the token bucket's rate scale with 1 / time_scale).
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import re
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..devtools.client import HttpClient
from ..devtools.stack import Stack
from ..devtools.upstream import SEQ_HEADER, Upstream

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
    #: it reached the upstream with Envoy's fail-open header: no decision of ours let it through
    unchecked: bool = False


CSV_FIELDS = ("flow", "user", "tier", "sent", "answered", "status", "tokens_left", "upstream_start",
              "upstream_end", "unchecked")
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
        rows = ["| flow | sent | 200 | 429 | 503 | passed unchecked |", "|---|---:|---:|---:|---:|---:|"]
        counts: dict[str, Counter[int]] = {}
        unchecked: Counter[str] = Counter()
        for r in self.results:
            counts.setdefault(r.flow, Counter())[r.status] += 1
            unchecked[r.flow] += r.unchecked
        for flow in self.flows:
            c = counts.get(flow.label, Counter())
            rows.append(f"| {flow.label} | {sum(c.values())} | {c[200]} | {c[429]} | {c[503]} | "
                        f"{unchecked[flow.label]} |")
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
                            "" if up is None else f"{up[0]:.4f}", "" if up is None else f"{up[1]:.4f}",
                            int(r.unchecked)])
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
                sc.results[i].unchecked = seq in upstream.unchecked
                upstream.unchecked.discard(seq)


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


#: the fleet picture's limiter (the POLICY's ``fleet``): its capacity and non-critical's share
FLEET_CAPACITY, FLEET_CEILING = 16, 12
#: picture 3: the words of its caption, for its legend
FLEET_WORDS = {"get": "non-critical traffic", "critical": "critical traffic"}


def fleet_series(results: Sequence[Sent], grid: Sequence[float]) -> list[tuple[str, str, list[int]]]:
    """The fleet picture's stacked series on ``grid``: (tier colour, label, in flight at each
    time): non-critical requests the limiter admitted, those that passed unchecked (only when
    there are any, with their count), critical ones on top."""
    def steps(pick: Callable[[Sent], bool]) -> list[int]:
        ts, ns = in_flight(r.upstream for r in results if r.upstream is not None and pick(r))
        return [ns[bisect.bisect_right(ts, g) - 1] for g in grid]

    out = [("get", f"{FLEET_WORDS['get']} in flight", steps(lambda r: r.tier == "get" and not r.unchecked))]
    unchecked = sum(1 for r in results if r.unchecked and r.upstream is not None)
    if unchecked:
        out.append(("get", f"passed unchecked ({unchecked}: Envoy's check timed out, no limiter counted them)",
                    steps(lambda r: r.unchecked)))
    out.append(("critical", f"{FLEET_WORDS['critical']} in flight (on top)",
                steps(lambda r: r.tier == "critical" and not r.unchecked)))
    return out


#: per outcome: a line style and a word
OUTCOMES = {200: ("-", "allowed"), 429: ("--", "429"), 503: (":", "503")}


#: picture 1's refill rate per user at time scale 1 (the policy's ``user-rate`` rate)
REFILL_PER_S = 20
#: picture 1: each user's line style, marker and width (the widest drawn first), so that users
#: whose lines coincide (bob's and carol's full buckets) all stay visible
USER_STYLES = (("-", "o", 3.4), ("--", "s", 2.4), (":", "^", 1.4), ("-.", "D", 1.0))


def plot(sc: Scenario, out: Path, scale: float) -> Path:
    from .simulate.report import require_matplotlib

    plt = require_matplotlib()
    fig = draw(sc, scale)
    path = out / f"{sc.name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def draw(sc: Scenario, scale: float) -> Any:
    """The scenario's picture (a matplotlib Figure, not yet saved: tests read its lines,
    labels and limits)."""
    from .simulate.report import TIER_COLORS, legend_outside, require_matplotlib

    plt = require_matplotlib()
    width = 0.5 * scale
    bins = max(1, int(sc.duration / width) + 1)
    xs = [(i + 0.5) * width for i in range(bins)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    users = list(dict.fromkeys(f.user for f in sc.flows))
    color_of = {u: colors[i % len(colors)] for i, u in enumerate(users)}
    style_of = {u: USER_STYLES[i % len(USER_STYLES)] for i, u in enumerate(users)}
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
            style, marker, lw = style_of[u]
            top.step([t for t, _ in tokens], [v for _, v in tokens], where="post", color=color_of[u],
                     linestyle=style, linewidth=lw, marker=marker, markersize=3, markevery=0.05,
                     label=f"{u}: tokens left")
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
        capacity, ceiling = FLEET_CAPACITY, FLEET_CEILING
        grid = [i * sc.duration / 600 for i in range(601)]
        stacked = fleet_series(sc.results, grid)  # labels in the caption's words
        polys = top.stackplot(grid, [ys for _, _, ys in stacked], colors=[TIER_COLORS[t] for t, _, _ in stacked],
                              alpha=0.75, labels=[label for _, label, _ in stacked], step="post")
        for poly, (_, label, _) in zip(polys, stacked, strict=True):
            if "unchecked" in label:  # no limiter counted these: hatched, and counted in the label
                poly.set_hatch("xx")
                poly.set_edgecolor("#d62728")
        top.axhspan(ceiling, capacity, color=TIER_COLORS["critical"], alpha=0.08,
                    label=f"the reserved {capacity - ceiling} (critical only)")
        top.axhline(ceiling, color=TIER_COLORS["get"], linestyle="--", linewidth=1.2,
                    label=f"the {ceiling} of {capacity} slots it may use (non-critical)")
        top.axhline(capacity, color="black", linestyle="-", linewidth=1.2, label=f"{capacity} slots (capacity)")
        peak = max(map(sum, zip(*(ys for _, _, ys in stacked), strict=True)), default=0)
        top.set(ylabel="requests in flight", ylim=(0, max(capacity, peak) + 3),
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
        low = min([-0.1, *(lv for _, lv, _, _ in pts)]) - 0.05
        # the controller rests below 0 (-delay_before_shedding / time_to_shed_all): the climb
        # to 0 is the delay before anything is shed (extauthz/limiters/worker.py)
        mid.axhspan(low, 0, color="grey", alpha=0.12, label="below 0: the delay before shedding, nothing shed")
        mid.plot(times, [lv for _, lv, _, _ in pts], color="black", linewidth=1.6, label="shed level")
        mid.axhline(0, color="grey", linewidth=0.6)
        mid.set(ylabel="shed level\n(below 0: delay, none shed)", ylim=(low, 1.05))
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
        fleet = sc.name.startswith("3-")
        tier_of = {f.user: f.tier for f in sc.flows}
        series = _rates(sc.results, width, bins, lambda r: (r.user, r.status))
        for u in users:
            _, marker, lw = style_of[u]
            for status, (style, word) in OUTCOMES.items():
                found = series.get((u, status))
                if found is not None:
                    # the outcome picks the line style, the user the marker and width
                    rate_ax.plot(xs, found, style, color=TIER_COLORS[tier_of[u]] if fleet else color_of[u],
                                 linewidth=1.8 if fleet else lw, marker=marker, markersize=3,
                                 label=f"{FLEET_WORDS.get(tier_of[u], u) if fleet else u}: {word}")
        if sc.name.startswith("1-"):
            refill = REFILL_PER_S / scale
            rate_ax.axhline(refill, color="black", linestyle=(0, (1, 3)), linewidth=1.2,
                            label=f"refill rate: {refill:g} / s per user (faster empties the bucket)")
        rate_ax.set(ylabel="requests / s (sent, by outcome)")
    rate_ax.set(xlabel="seconds")
    legend_outside(top)
    legend_outside(rate_ax)
    fig.suptitle(textwrap.fill(sc.caption, 110), fontsize=10)
    fig.tight_layout()
    return fig


# -- the captions' claims, checked from the data written beside each picture ----------------

Rows = list[dict[str, str]]


def read_rows(path: Path) -> Rows:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _statuses(rows: Rows, **match: str) -> list[int]:
    return [int(r["status"]) for r in rows if all(r[k] == v for k, v in match.items())]


def _max_in_flight(rows: Rows, unchecked: bool | None = None, **match: str) -> int:
    """The most requests matching ``match`` in flight at once at the upstream (``unchecked``:
    only those that passed unchecked, or only the others)."""
    spans = [(float(r["upstream_start"]), float(r["upstream_end"])) for r in rows
             if r["upstream_start"] and all(r[k] == v for k, v in match.items())
             and (unchecked is None or _unchecked(r) == unchecked)]
    return max(in_flight(spans)[1])


def _unchecked(row: dict[str, str]) -> bool:
    return row.get("unchecked") == "1"  # data written before the column existed: none marked


def _passed_unchecked(rows: Rows, **match: str) -> str:
    n = sum(1 for r in rows if _unchecked(r) and all(r[k] == v for k, v in match.items()))
    if not n:
        return ""
    return (f" ({n} passed unchecked: Envoy's ext_authz check outlasted its timeout and "
            "failure_mode_allow let them through, with no lease)")


def check_request_rate(d: Path) -> list[str]:
    """The request-rate caption's claims that the data does not bear out (empty: it holds)."""
    rows = read_rows(d / "1-request-rate.csv")
    problems = []
    if 429 not in _statuses(rows, user="alice"):
        problems.append("alice, bursting, never got a 429" + _passed_unchecked(rows, user="alice"))
    for user in ("bob", "carol"):
        if set(_statuses(rows, user=user)) != {200}:
            problems.append(f"{user} was refused")
    tokens = {u: [float(r["tokens_left"]) for r in rows if r["user"] == u and r["tokens_left"]]
              for u in ("alice", "bob", "carol")}
    if not all(0 <= t <= 20 for ts in tokens.values() for t in ts):
        problems.append("tokens left outside the bucket (0 to the burst of 20)")
    if not all(tokens.values()) or min(tokens["alice"]) != 0 or min(tokens["bob"]) <= 0 \
            or min(tokens["carol"]) <= 0:
        problems.append("alice's bucket did not empty, or bob's or carol's did")
    return problems


def check_concurrency(d: Path) -> list[str]:
    rows = read_rows(d / "2-concurrency.csv")
    problems = []
    dave = _max_in_flight(rows, user="dave")
    if dave != 4:  # up to the limit, never above it
        problems.append(f"dave had {dave} requests in flight, not the limit of 4"
                        + _passed_unchecked(rows, user="dave"))
    if _max_in_flight(rows, user="erin") > 2:
        problems.append("erin had more than her 2 requests in flight")
    if 429 not in _statuses(rows, user="dave"):
        problems.append("dave never got a 429")
    if set(_statuses(rows, user="erin")) != {200}:
        problems.append("erin was refused")
    return problems


def check_fleet(d: Path) -> list[str]:
    rows = read_rows(d / "3-fleet-usage.csv")
    problems = []
    most = _max_in_flight(rows, tier="get")
    if most != FLEET_CEILING:  # non-critical fills its 12 of 16 slots, no more
        checked = _max_in_flight(rows, unchecked=False, tier="get")
        problems.append(f"{most} non-critical requests in flight at once, not the {FLEET_CEILING} of "
                        f"{FLEET_CAPACITY} slots it may use (the limiter's own: {checked})"
                        + _passed_unchecked(rows, tier="get"))
    if 503 not in _statuses(rows, tier="get"):
        problems.append("non-critical traffic never got a 503")
    if set(_statuses(rows, tier="critical")) != {200}:  # critical is never refused
        problems.append("critical traffic was refused")
    # ... nor stalled by the generator: answers keep coming, never a gap of two request times
    critical = sorted((float(r["sent"]), float(r["answered"])) for r in rows if r["tier"] == "critical")
    if len(critical) < 2:
        return [*problems, "fewer than two critical requests"]
    took = statistics.median(b - a for a, b in critical)
    answers = sorted(b for _, b in critical)
    gap = max(b - a for a, b in itertools.pairwise(answers))
    if gap >= 2 * took:
        problems.append(f"critical answers stalled: a gap of {gap:.2f} s (a request takes {took:.2f} s)")
    return problems


def check_workers(d: Path) -> list[str]:
    rows = read_rows(d / "4-worker-utilization.csv")
    problems = []
    if set(_statuses(rows, tier="critical")) != {200}:
        problems.append("critical traffic was shed")
    refused = {tier: [float(r["sent"]) for r in rows if r["tier"] == tier and r["status"] == "503"]
               for tier in ("test", "get", "post")}
    # shed in order: test first, then get, then post, each tier at least as much as the next
    if not all(refused.values()) or not min(refused["test"]) < min(refused["get"]) < min(refused["post"]):
        problems.append("tiers not shed in order (test, then get, then post)")
    if not len(refused["test"]) >= len(refused["get"]) >= len(refused["post"]) > 0:
        problems.append("a tier was shed more than a lower one, or post never")
    shedder = read_rows(d / "4-worker-utilization-shedder.csv")
    for s in shedder:
        p = [float(s[f"p_{tier}"]) for tier in ("test", "get", "post", "critical")]
        if not (p[0] >= p[1] >= p[2] >= p[3] == 0.0 and 0.0 <= float(s["utilization"]) <= 1.0
                and float(s["level"]) <= 1.0):
            problems.append(f"shedder state out of order at {s['time']} s")
            break
    levels = [float(s["level"]) for s in shedder]
    if not levels or not (levels[0] < 0 and max(levels) > 2 / 3 and levels[-1] < 0):
        problems.append("the shed level did not rest, shed post too, and recover")
    return problems


#: each picture's caption check: the claims its data does not bear out (empty: it holds)
CAPTION_CHECKS: dict[str, Callable[[Path], list[str]]] = {
    "1-request-rate": check_request_rate, "2-concurrency": check_concurrency,
    "3-fleet-usage": check_fleet, "4-worker-utilization": check_workers}


def check_captions(d: Path, names: Iterable[str] = CAPTION_CHECKS) -> dict[str, list[str]]:
    """Each named picture's caption check on the data in ``d``."""
    return {name: CAPTION_CHECKS[name](d) for name in names}


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
        rate=f"{REFILL_PER_S / s:.3f}", sample=f"{0.1 * s:.3f}s", delay=f"{1.0 * s:.3f}s", shed_all=f"{3.0 * s:.3f}s"))
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
        time.sleep(0.1)  # the last access-log entries (sent every 5 ms)
        counted = _status(admin, client).get("unchecked_requests") or {"total": 0, "by_tier": {}}
    seen = sum(r.unchecked for sc in todo for r in sc.results)
    unchecked = (f"Requests Envoy let through unchecked (its ext_authz check outlasted its timeout): "
                 f"{seen} seen at the upstream with its fail-open header; the server counted "
                 f"{counted['total']} from the access log "
                 f"({', '.join(f'{t} {n}' for t, n in counted['by_tier'].items() if n) or 'none'}).")
    print(f"\n{unchecked}")
    md += [unchecked, ""]
    verdicts = check_captions(out, sorted(sc.name for sc in todo))
    print("\nCaption checks (each caption's claims against the data beside it):")
    for name, problems in verdicts.items():
        print(f"  {name}: " + ("holds" if not problems else "DOES NOT HOLD: " + "; ".join(problems)))
    for sc in sorted(todo, key=lambda sc: sc.name):
        names = [f"{sc.name}.csv"] + ([f"{sc.name}-shedder.csv"] if sc.shedder else [])
        problems = verdicts[sc.name]
        md += [f"## {sc.name}", "", f"![{sc.caption}]({sc.name}.png)", "", sc.caption, "", sc.table(), "",
               "Data: " + ", ".join(f"[{n}]({n})" for n in names) + ".", "",
               "Caption checked against the data: " + ("holds." if not problems else
                                                       "**does not hold**: " + "; ".join(problems) + "."), ""]
    (out / "pictures.md").write_text("\n".join(md))
    return 0 if not any(verdicts.values()) else 1
