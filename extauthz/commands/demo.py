"""The quick start: a real Envoy, the server on the embedded store, a tiny upstream, and a
burst of traffic per tier, then a summary of what got through, what was refused and why.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..devtools.client import HttpClient, Result
from ..devtools.stack import Stack


@dataclass
class Phase:
    name: str
    what: str
    results: list[Result]

    def row(self) -> str:
        codes = Counter(r.status for r in self.results)
        tiers = Counter(r.tier for r in self.results if r.tier)
        refused_by = Counter(r.limiter for r in self.results if r.limiter)
        tier = ",".join(sorted(tiers)) or "-"
        why = ", ".join(f"{n}x {lim}" for lim, n in refused_by.most_common()) or "-"
        return (f"{self.name:<24} {len(self.results):>5} {codes.get(200, 0):>6} {codes.get(429, 0):>5} "
                f"{codes.get(503, 0):>5}  {tier:<9} {why}")


def run_phases(url: str, client: HttpClient) -> list[Phase]:
    send = client.send
    phases = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        live = {"x-api-key": "sk_live_demo_alice"}
        results = list(pool.map(lambda _: send(url + "/v1/customers", headers=live), range(800)))
        phases.append(Phase("live GETs, one user", "800 GETs at once against rate 100/s burst 500", results))

        bob = {"authorization": "Bearer sk_live_demo_bob"}
        results = list(pool.map(lambda _: send(url + "/v1/charges", "POST", bob), range(50)))
        phases.append(Phase("POST /v1/charges", "the route says critical", results))

        results = list(pool.map(lambda _: send(url + "/v1/reports/daily", headers=bob), range(50)))
        phases.append(Phase("GET /v1/reports", "the route says get", results))

        test = {"x-api-key": "sk_test_demo_carol"}
        results = list(pool.map(lambda _: send(url + "/v1/charges", "POST", test), range(50)))
        phases.append(Phase("test-mode key", "sk_test_ keys are always the test tier", results))

    # 30 slow requests at once from one user: the concurrency limit (20) refuses 10.
    dave = {"x-api-key": "sk_live_demo_dave"}
    with ThreadPoolExecutor(max_workers=30) as pool:
        results = list(pool.map(lambda _: send(url + "/v1/slow?delay=1.0", headers=dave), range(30)))
    phases.append(Phase("30 slow GETs in flight", "concurrency limit 20 per user", results))
    time.sleep(0.2)  # the access log releases the 20 leases as the responses finish
    results = [send(url + "/v1/customers", headers=dave) for _ in range(5)]
    phases.append(Phase("same user, right after", "leases released by Envoy's access log", results))
    return phases


def main(policies: Sequence[str] | None = None, protocol: str = "grpc") -> int:
    paths = list(policies or ["policies"])
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"extauthz demo: {', '.join(missing)} not found; run it from the repository root "
              "or pass --policies", file=sys.stderr)
        return 2
    config = "envoy/envoy-http.yaml" if protocol == "http" else "envoy/envoy.yaml"
    print(f"Starting a tiny upstream, the extauthz server (embedded store) and Envoy ({protocol} "
          "authorization protocol) ...")
    started = time.monotonic()
    with Stack(paths, protocol=protocol) as stack:
        assert stack.envoy is not None and stack.server is not None
        print(f"  Envoy      {stack.url}  (config {config}, admin {stack.envoy.admin_url})")
        if protocol == "http":
            print(f"  extauthz   HTTP authorization 127.0.0.1:{stack.http_port}, gRPC (access log) "
                  f"127.0.0.1:{stack.server.port}  (policies: {', '.join(paths)})")
        else:
            print(f"  extauthz   127.0.0.1:{stack.server.port}  (policies: {', '.join(paths)})")
        print(f"  ready in {time.monotonic() - started:.1f} s\n")
        with HttpClient() as client:
            phases = run_phases(stack.url, client)
        print(f"{'phase':<24} {'sent':>5} {'200':>6} {'429':>5} {'503':>5}  {'tier':<9} refused by")
        print("-" * 88)
        for phase in phases:
            print(phase.row())
        print()
        allowed = next((r for r in phases[0].results if r.status == 200), None)
        refused = next((r for r in phases[0].results if r.status == 429), None)
        if allowed is not None:
            print("An allowed response carries:")
            print(f"  RateLimit-Policy: {allowed.headers.get('ratelimit-policy')}")
            print(f"  RateLimit:        {allowed.headers.get('ratelimit')}")
        if refused is not None:
            print("A refused one (429) carries:")
            print(f"  Retry-After: {refused.headers.get('retry-after')}")
            print(f"  RateLimit:   {refused.headers.get('ratelimit')}")
            print(f"  body: {refused.body}")
        print("\nWhy: 'user-rate' is a token bucket (100/s, burst 500) per API key; "
              "'user-concurrency' allows 20 requests in flight per key,\nreleased when Envoy's "
              "access log reports each request finished. Tiers come from the route "
              f"({config}),\nthe policy's rules (policies/api.yaml) or the method.")
    return 0
