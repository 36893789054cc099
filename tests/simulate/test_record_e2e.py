"""A recording made by the server behind a real Envoy replays to the decisions it made."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from extauthz.commands.simulate.replay import Replay, ReplayedRequest
from extauthz.commands.simulate.traffic import BadLines, TrafficFile, read_traffic
from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack
from extauthz.policy import load_policy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICY = {"version": 1, "identity": [{"header": "x-api-key"}], "limiters": [
    # far from any boundary: replay time deltas differ from the server's by microseconds
    {"name": "user-rate", "type": "request_rate", "rate": 2, "burst": 5,
     "applies_to": {"path_prefix": "/rate/"}},
    {"name": "user-concurrency", "type": "concurrent_requests", "limit": 3,
     "applies_to": {"path_prefix": "/slow/"}},
    {"name": "shadow-rate", "type": "request_rate", "rate": 1, "burst": 2, "mode": "shadow"},
]}


def test_recording_replays_to_the_servers_decisions(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "p.yaml").write_text(yaml.safe_dump(POLICY))
    record = tmp_path / "record"
    with Stack([policies], server_args=["--record", str(record)]) as stack, HttpClient() as client:
        url = stack.url
        alice = {"x-api-key": "sk_live_alice"}
        first = [client.send(url + "/rate/v1/x", headers=alice).status for _ in range(12)]
        time.sleep(1.6)
        second = [client.send(url + "/rate/v1/x", headers=alice).status for _ in range(5)]
        dave = {"x-api-key": "sk_live_dave"}
        with ThreadPoolExecutor(max_workers=6) as pool:
            slow = list(pool.map(lambda _: client.send(url + "/slow/v1/x?delay=0.5", headers=dave).status,
                                 range(6)))
        time.sleep(0.3)
        after = [client.send(url + "/slow/v1/x", headers=dave).status for _ in range(3)]
        time.sleep(0.5)  # the last access-log entries arrive
    assert first.count(200) == 5 and second.count(200) == 3
    assert sorted(slow) == [200] * 3 + [429] * 3 and after == [200] * 3

    files = [TrafficFile(p) for p in sorted(record.glob("record-*.jsonl.gz"))]
    assert files, "no recording written"
    seen: list[tuple[str | None, str]] = []

    def compare(r: ReplayedRequest) -> None:
        d = r.candidate
        seen.append((r.request.recorded, "allowed" if d.allowed else d.denied_by.limiter))  # type: ignore[union-attr]

    requests = list(read_traffic(files, bad=BadLines()))
    assert len(requests) == 12 + 5 + 6 + 3
    assert all(r.duration is not None for r in requests)
    assert sum(1 for r in requests if r.duration is not None and r.duration >= 0.5) == 3
    Replay(load_policy([policies]), on_decision=compare).run(requests)
    assert [a for a, _ in seen] == [b for _, b in seen]
    assert [a for a, _ in seen].count("user-rate") == 7 + 2
    assert [a for a, _ in seen].count("user-concurrency") == 3
