"""Make the recording behind docs/tuning.md's example: the quick start's stack with
``serve --record``, and half a minute of mixed traffic from a few kinds of users.

    python -m bench.record_example OUT_DIR [--seconds 30]

Users: 20 ordinary ones (about 4 requests/s each, short requests, some POSTs), a batch job
(150 requests/s for a third of the run), a reporting client holding 15 slow requests in
flight, and payments (critical POST /v1/charges). The recording lands in OUT_DIR/record.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    record = Path(args.out) / "record"
    sent = [0]
    lock = threading.Lock()
    with Stack([ROOT / "policies"], server_args=["--record", str(record)]) as stack, HttpClient() as client:
        url = stack.url
        t0 = time.monotonic()
        end = t0 + args.seconds

        def user(key: str, rps: float, path: str, method: str = "GET", start: float = 0.0,
                 stop: float = 1.0, seed: int = 0) -> None:
            rng = random.Random(seed)
            begin, finish = t0 + start * args.seconds, t0 + stop * args.seconds
            time.sleep(max(0.0, begin - time.monotonic()))
            while time.monotonic() < min(finish, end):
                delay = f"?delay={rng.uniform(0.005, 0.05):.3f}" if "delay" not in path else ""
                client.send(url + path + delay, method, {"x-api-key": key})
                with lock:
                    sent[0] += 1
                time.sleep(rng.expovariate(rps))

        jobs = [threading.Thread(target=user, args=(f"sk_live_user{i}", 4.0,
                                                    "/v1/customers", "POST" if i % 4 == 0 else "GET"),
                                 kwargs={"seed": i}) for i in range(20)]
        jobs += [threading.Thread(target=user, args=("sk_live_batchjob", 150.0 / 4, "/v1/customers"),
                                  kwargs={"start": 0.3, "stop": 0.65, "seed": 100 + k}) for k in range(4)]
        jobs += [threading.Thread(target=user, args=("sk_live_reports", 100.0, "/v1/reports/daily?delay=0.6"),
                                  kwargs={"start": 0.1, "stop": 0.9, "seed": 200 + k}) for k in range(15)]
        jobs += [threading.Thread(target=user, args=(f"sk_live_pay{k}", 3.0, "/v1/charges", "POST"),
                                  kwargs={"seed": 300 + k}) for k in range(3)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        time.sleep(0.5)  # the last access-log entries
    print(f"sent {sent[0]} requests; recording in {record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
