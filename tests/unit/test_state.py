"""The per-component state (extauthz/engine/state.py): each part renders the same figures
as /status keys and as metric families, and a new component's part shows in both."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from extauthz.control.switches import Switches
from extauthz.core.clock import ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.core.verdict import Mode
from extauthz.engine.engine import Engine
from extauthz.engine.state import Panel, by_label_part, count_part
from extauthz.engine.storegate import StoreGate
from extauthz.store.memory import MemoryStore
from testinfra.probes import engine_parts

from .helpers import FaultyStore, get, policy_from

POLICY: dict[str, Any] = {"limiters": [
    {"name": "user-rate", "type": "request_rate", "rate": 10, "burst": 20}]}


def scrape(panel: Panel) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(panel)
    return registry


async def test_the_engine_parts_give_the_same_figures_to_status_and_metrics(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = FaultyStore(MemoryStore(clock), check_error=StoreUnavailable("down"))
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, POLICY))
    for _ in range(3):
        await engine.check(get())
    engine.set_switches(Switches(global_mode=Mode.SHADOW))
    panel = Panel(engine_parts(engine))
    status, registry = panel.status(), scrape(panel)

    assert status["fail_open"] == {"unavailable": 3}
    assert registry.get_sample_value("extauthz_fail_open_total", {"reason": "unavailable"}) == 3
    assert registry.get_sample_value("extauthz_fail_open_total", {"reason": "timeout"}) == 0
    assert status["switches"] == {"*": "shadow"} and status["limiters"]["user-rate"]["mode"] == "shadow"
    assert registry.get_sample_value("extauthz_limiter_mode", {"limiter": "user-rate", "mode": "shadow"}) == 1
    assert registry.get_sample_value("extauthz_switches_set", {"switch": "*", "mode": "shadow"}) == 1
    version = status["policy"]["version"]
    assert registry.get_sample_value("extauthz_policy_info", {"version": version}) == 1
    assert status["store"]["name"] == "faulty" and status["store"]["breaker"] == "closed"
    assert status["store"]["window_failures"] == 3
    assert registry.get_sample_value("extauthz_store_breaker_open") == 0
    assert status["store"]["deadline_extended"] == 0
    assert registry.get_sample_value("extauthz_store_deadline_extended_total") == 0


def test_window_failures_count_the_masters_breakers_on_a_cluster(tmp_path: Path) -> None:
    """On Redis Cluster each master's breaker counts its failures; the engine's own breaker is
    only their template and counts none."""
    engine = Engine(StoreGate(MemoryStore(ManualClock(1000.0))), policy_from(tmp_path, POLICY))
    for name, failures in (("m1", 2), ("m2", 1)):
        breaker = engine.gate.node_breakers[name] = engine.gate.breaker.like()
        for _ in range(failures):
            breaker.failure()
    status = Panel(engine_parts(engine)).status()["store"]
    assert status["window_failures"] == 3 and status["masters"] == {"m1": "closed", "m2": "closed"}


def test_a_new_component_adds_one_part_and_shows_in_both() -> None:
    class Grants:
        """A component with state of its own (e.g. batched limiters' grant counters)."""

        taken = 7

        def status(self) -> Mapping[str, Any]:
            return {"grants": {"taken": self.taken}}

        def metrics(self) -> Iterable[Metric]:
            yield CounterMetricFamily("extauthz_grants_taken", "Grants taken.", value=self.taken)

    errors = {"switch_poll": 2}
    panel = Panel([count_part("bad_requests", "extauthz_bad_requests", "Unreadable.", lambda: 4),
                   by_label_part("background_errors", "extauthz_background_errors", "Raised.", "job",
                                 lambda: errors)])
    panel.add(Grants())
    registry = scrape(panel)
    assert panel.status() == {"bad_requests": 4, "background_errors": {"switch_poll": 2},
                              "grants": {"taken": 7}}
    assert registry.get_sample_value("extauthz_bad_requests_total") == 4
    assert registry.get_sample_value("extauthz_background_errors_total", {"job": "switch_poll"}) == 2
    assert registry.get_sample_value("extauthz_grants_taken_total") == 7
    errors["switch_poll"] = 3  # read at every scrape and status, never copied
    assert panel.status()["background_errors"] == {"switch_poll": 3}
    assert registry.get_sample_value("extauthz_background_errors_total", {"job": "switch_poll"}) == 3
