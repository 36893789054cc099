"""``extauthz demo --pictures DIR``: Stripe's four pictures, through the real stack.

One stack (the tiny upstream, the server on the embedded store, a real Envoy with the
shipped config) runs a policy with one limiter per picture, each scoped to its own path
prefix, and four traffic scenarios one after the other. Every request the traffic
generator sends is kept as (time, flow, status); each picture plots requests per second by
flow and outcome, with a one-line caption and a summary table.

``time_scale`` stretches or shrinks every duration (traffic phases, slow requests, the
worker shedder's controller constants): 1.0 takes about a minute, the CI smoke test
runs at 0.3 (request rates and the token bucket's rate scale with 1 / time_scale).
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .devtools.client import HttpClient
from .devtools.stack import Stack

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
    loop (the next request when the last answered, after ``pause`` if it was refused)."""

    label: str
    path: str
    key: str
    method: str = "GET"
    threads: int = 1
    rate: float | None = None
    start: float = 0.0
    stop: float = 1.0
    pause: float = 0.05
    #: seconds between starting one thread and the next (a ramp)
    stagger: float = 0.0


@dataclass
class Scenario:
    name: str
    caption: str
    duration: float
    flows: list[Flow]
    results: list[tuple[float, str, int]] = field(default_factory=list)

    def table(self) -> str:
        rows = ["| flow | sent | 200 | 429 | 503 |", "|---|---:|---:|---:|---:|"]
        counts: dict[str, Counter[int]] = {}
        for _, label, status in self.results:
            counts.setdefault(label, Counter())[status] += 1
        for flow in self.flows:
            c = counts.get(flow.label, Counter())
            rows.append(f"| {flow.label} | {sum(c.values())} | {c[200]} | {c[429]} | {c[503]} |")
        return "\n".join(rows)


def scenarios(scale: float) -> list[Scenario]:
    s = scale
    slow = f"?delay={0.5 * s:.3f}"
    return [
        Scenario(
            "1-request-rate",
            "Request rate: alice bursts far above her rate and gets 429s; bob and carol pass.",
            6 * s, [
                Flow("alice", "/rate/v1/customers", "sk_live_alice", threads=1, rate=10 / s, stop=6 * s),
                Flow("alice burst", "/rate/v1/customers", "sk_live_alice", threads=4, rate=25 / s,
                     start=2 * s, stop=4 * s),
                Flow("bob", "/rate/v1/customers", "sk_live_bob", rate=10 / s, stop=6 * s),
                Flow("carol", "/rate/v1/customers", "sk_live_carol", rate=10 / s, stop=6 * s),
            ]),
        Scenario(
            "2-concurrency",
            "Concurrency: dave keeps 10 slow requests going, 4 in flight pass, the rest get 429; "
            "erin's 2 pass.",
            5 * s, [
                Flow("dave", "/conc/v1/slow" + slow, "sk_live_dave", threads=10, stop=5 * s, pause=0.1 * s,
                     stagger=0.2 * s),
                Flow("erin", "/conc/v1/slow" + slow, "sk_live_erin", threads=2, stop=5 * s),
            ]),
        Scenario(
            "3-fleet-usage",
            "Fleet usage: as non-critical traffic ramps past 12 of 16 slots it gets 503; "
            "critical traffic always passes.",
            6 * s, [
                Flow("non-critical GET", "/fleet/v1/items" + slow, "sk_live_many", threads=20,
                     stop=6 * s, pause=0.1 * s, stagger=0.15 * s),
                Flow("critical POST", "/fleet/critical" + slow, "sk_live_pay", method="POST", threads=3,
                     stop=6 * s),
            ]),
        Scenario(
            "4-worker-utilization",
            "Worker utilization: while slow requests keep the workers busy, test traffic is shed "
            "first, then GET, then POST, critical never; it comes back gradually.",
            13 * s, [
                Flow("test", "/workers/v1/items", "sk_test_t", rate=20 / s, stop=13 * s),
                Flow("get", "/workers/v1/items", "sk_live_g", rate=20 / s, stop=13 * s),
                Flow("post", "/workers/v1/items", "sk_live_p", method="POST", rate=20 / s, stop=13 * s),
                Flow("critical", "/workers/critical", "sk_live_c", method="POST", rate=20 / s, stop=13 * s),
                # The shedder's inflight signal counts the fleet limiter's leases (policy above):
                # slow critical requests there keep the "workers" busy, never refused themselves.
                Flow("busy workers (critical, slow)", "/fleet/critical" + slow, "sk_live_busy",
                     method="POST", threads=10, start=1.5 * s, stop=7 * s),
            ]),
    ]


def run_scenario(url: str, client: HttpClient, sc: Scenario) -> None:
    t0 = time.monotonic() + 0.05
    lock = threading.Lock()

    def sender(flow: Flow, k: int) -> None:
        begin = t0 + flow.start + k * flow.stagger
        delay = begin - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        n = 0
        headers = {"x-api-key": flow.key if flow.key != "sk_live_many" else f"sk_live_many_{k}"}
        while True:
            now = time.monotonic()
            if now >= t0 + flow.stop:
                return
            status = client.send(url + flow.path, flow.method, headers).status
            with lock:
                sc.results.append((now - t0, flow.label, status))
            n += 1
            if flow.rate is not None:
                wait = begin + n / flow.rate - time.monotonic()
            else:
                wait = flow.pause if status != 200 else 0.0
            if wait > 0:
                time.sleep(wait)

    threads = [threading.Thread(target=sender, args=(flow, k), daemon=True)
               for flow in sc.flows for k in range(flow.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def plot(sc: Scenario, out: Path, scale: float) -> Path:
    from .simulate.report import require_matplotlib

    plt = require_matplotlib()
    width = 0.5 * scale
    bins = max(1, int(sc.duration / width) + 1)
    xs = [i * width for i in range(bins)]
    series: dict[tuple[str, int], list[float]] = {}
    for t, label, status in sc.results:
        i = int(t / width)
        if 0 <= i < bins:
            series.setdefault((label, status), [0.0] * bins)[i] += 1 / width
    fig, ax = plt.subplots(figsize=(9, 4.2))
    styles = {200: "-", 429: "--", 503: ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, flow in enumerate(sc.flows):
        for status in (200, 429, 503):
            ys = series.get((flow.label, status))
            if ys is not None:
                busy = flow.label.startswith("busy")
                ax.plot(xs, ys, styles[status], color=colors[j % len(colors)],
                        linewidth=0.8 if busy else 1.6, alpha=0.35 if busy else 1.0,
                        label=f"{flow.label}: {status}")
    ax.set(xlabel="seconds", ylabel="requests / s (what the clients saw)", title=textwrap.fill(sc.caption, 100))
    ax.title.set_fontsize(9)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path = out / f"{sc.name}.png"
    fig.savefig(path, dpi=100)
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
        for sc in todo:
            run_scenario(stack.url, client, sc)
            path = plot(sc, out, s)
            print(f"\n{path}: {sc.caption}\n{sc.table()}")
    for sc in sorted(todo, key=lambda sc: sc.name):
        md += [f"## {sc.name}", "", f"![{sc.caption}]({sc.name}.png)", "", sc.caption, "", sc.table(), ""]
    (out / "pictures.md").write_text("\n".join(md))
    return 0
