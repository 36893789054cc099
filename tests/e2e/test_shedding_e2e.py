"""The worker utilization shedder through a real Envoy, on Redis, driven by the `redis`
signal with a short timescale (1 s delay, 6 s to shed all): test traffic is shed first, then
GETs, then POSTs; critical traffic passes throughout; traffic comes back gradually."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack
from testinfra.redis_servers import RedisSingle

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]

SIGNAL_KEY = "extauthz:signal:workers"
TIERS = {
    "test": ("GET", "/v1/customers", {"x-api-key": "sk_test_drill"}),
    "get": ("GET", "/v1/customers", {"x-api-key": "sk_live_drill"}),
    "post": ("POST", "/v1/customers", {"x-api-key": "sk_live_drill"}),
    "critical": ("POST", "/v1/charges", {"x-api-key": "sk_live_drill"}),
}


def drill_policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}],
        "test_mode": {"key_prefix": "sk_test_"},
        "limiters": [{
            "name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
            "sample_interval": "0.2s", "good_below": 0.7, "bad_above": 0.8,
            "delay_before_shedding": "1s", "time_to_shed_all": "6s",
        }],
    }))
    return directory


def observe(client: HttpClient, url: str, seconds: float) -> list[tuple[float, str, int]]:
    """One request per tier every 50 ms: (elapsed, tier, status)."""
    start = time.monotonic()
    seen = []
    while (now := time.monotonic() - start) < seconds:
        for tier, (method, path, headers) in TIERS.items():
            seen.append((now, tier, client.send(url + path, method, headers).status))
        time.sleep(0.05)
    return seen


def first(seen: list[tuple[float, str, int]], tier: str, status: int) -> float:
    return next(t for t, tr, s in seen if tr == tier and s == status)


def test_shed_test_then_get_then_post_never_critical(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    r = redis_single_clean.client()
    r.set(SIGNAL_KEY, "0.1")
    with Stack([drill_policy(tmp_path / "p")], server_args=["--redis-url", redis_single_clean.url]) as stack, \
            HttpClient() as client:
        calm = observe(client, stack.url, 1.0)
        assert {s for _, _, s in calm} == {200}

        r.set(SIGNAL_KEY, "1.0")  # every worker busy, from now on
        ramp = observe(client, stack.url, 8.5)
        assert all(s == 200 for _, tier, s in ramp if tier == "critical")
        t_test, t_get, t_post = (first(ramp, tier, 503) for tier in ("test", "get", "post"))
        # nothing before delay_before_shedding (1 s, allow one sample interval of slack)
        assert t_test >= 0.8, t_test
        assert t_test < t_get < t_post, (t_test, t_get, t_post)
        # after delay + time_to_shed_all (7 s) all non-critical traffic is shed
        tail = [(tier, s) for t, tier, s in ramp if t > 7.6]
        assert tail and all(s == 503 for tier, s in tail if tier != "critical")
        shed = next(rr for rr in ramp if rr[2] == 503)
        assert shed[1] == "test"

        r.set(SIGNAL_KEY, "0.0")  # recovery is as gradual as the ramp
        recovery = observe(client, stack.url, 7.5)
        assert all(s == 200 for _, tier, s in recovery if tier == "critical")
        b_post, b_get, b_test = (first(recovery, tier, 200) for tier in ("post", "get", "test"))
        assert b_post < b_get < b_test, (b_post, b_get, b_test)
        assert b_test > 2.5  # not all at once: test traffic comes back last (~6 s)
        late = [(tier, s) for t, tier, s in recovery if t > 6.8]
        assert late and all(s == 200 for _, s in late)
