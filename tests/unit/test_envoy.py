"""extauthz/envoy/: the package imports no server module, and a protocol target is a module plus
its line in ``TARGETS`` (docs/design.md "Envoy knowledge")."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from extauthz.envoy import config
from extauthz.envoy.blocks import Config, cluster, strip
from extauthz.envoy.config import TARGETS, Build, Target, bootstrap
from extauthz.policy import load_policy

from ..conftest import ROOT

PACKAGE = ROOT / "extauthz" / "envoy"


def imported_modules(path: Path) -> list[str]:
    """The absolute name of every module ``path`` imports (relative imports resolved)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = parts[:-node.level] if node.level else []
            out.append(".".join([*base, *([node.module] if node.module else [])]))
    return out


def test_the_envoy_package_imports_no_server_module() -> None:
    found = {f"{p.name}: {m}" for p in PACKAGE.rglob("*.py") for m in imported_modules(p)
             if m == "extauthz.server" or m.startswith("extauthz.server.")}
    assert found == set()


def test_importing_the_envoy_package_loads_no_server_module() -> None:
    # the AST check above sees direct imports only; this one sees what they import in turn
    modules = [f"extauthz.envoy.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'extauthz.server' or m.startswith('extauthz.server.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_check_sees_its_own_imports() -> None:
    # the check resolves relative imports: httpmap's ..envoy.headers is extauthz.envoy.headers
    assert "extauthz.envoy.headers" in imported_modules(ROOT / "extauthz" / "server" / "httpmap.py")
    assert "extauthz.server.leases" in imported_modules(ROOT / "extauthz" / "server" / "fluentd.py")


class Probe:
    """A protocol target written as a new one would be: one strip filter, one cluster."""

    default_authz = ("127.0.0.1", 9501)
    grpc_cluster: str | None = None
    carries_metadata = False
    tls = False

    def filters(self, b: Build) -> list[Config]:
        return [strip("probe.strip", ["x-probe"])]

    def clusters(self, b: Build) -> list[Config]:
        return [cluster("probe", b.authz, "0.25s")]

    def manager(self, b: Build, hcm: Config, vhost: Config) -> None:
        hcm["probe_seen"] = b.options.protocol

    def skip_route(self, b: Build) -> Config:
        return {}

    def route_tier(self, b: Build, tier: str) -> Config:
        return {"metadata": {"filter_metadata": {"probe": {"tier": tier}}}}

    def extension_route(self, b: Build, tier: str) -> Config:
        return self.route_tier(b, tier)


def test_a_registered_target_renders_through_the_one_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    probe: Target = Probe()
    policy = load_policy([ROOT / "policies"])
    with pytest.raises(ValueError, match="protocol must be one of grpc, http, not 'probe'"):
        bootstrap(policy, protocol="probe", upstream=("127.0.0.1", 8080))
    monkeypatch.setitem(TARGETS, "probe", probe)
    built: dict[str, Any] = bootstrap(policy, protocol="probe", upstream=("127.0.0.1", 8080),
                                      quickstart_routes=True, access_log="never")
    hcm = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["probe.strip", "envoy.filters.http.router"]
    assert hcm["probe_seen"] == "probe"
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    assert routes["reports"]["metadata"] == {"filter_metadata": {"probe": {"tier": "get"}}}
    assert "typed_per_filter_config" not in routes["healthz"]
    clusters = [c["name"] for c in built["static_resources"]["clusters"]]
    assert clusters == ["probe", "upstream"]
    port = built["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert port["endpoint"]["address"]["socket_address"]["port_value"] == 9501


def test_every_registered_target_has_the_target_shape() -> None:
    members = [m for m in vars(Target) if not m.startswith("_")] + list(Target.__annotations__)
    for name, target in config.TARGETS.items():
        assert all(hasattr(target, m) for m in members), name


@pytest.mark.parametrize(("option", "value", "message"), [
    ("check_budget_ms", float("nan"), "check_budget_ms must be a number of ms from 20 to 60000, not nan"),
    ("check_budget_ms", float("inf"), "check_budget_ms must be a number of ms from 20 to 60000, not inf"),
    ("check_budget_ms", -1000.0, "check_budget_ms must be a number of ms from 20 to 60000, not -1000.0"),
    ("check_budget_ms", 70_000.0, "check_budget_ms must be a number of ms from 20 to 60000, not 70000.0"),
    ("access_log_flush_ms", float("nan"), "access_log_flush_ms must be finite and not negative, not nan"),
    ("access_log_flush_ms", float("inf"), "access_log_flush_ms must be finite and not negative, not inf"),
    ("access_log_flush_ms", -1.0, "access_log_flush_ms must be finite and not negative, not -1.0"),
])
def test_options_refuse_a_budget_or_flush_interval_no_timeout_can_say(option: str, value: float, message: str) -> None:
    # the server's own range for the budget (serve --check-budget-ms): a negative one would
    # render a negative Envoy timeout, NaN and infinity no timeout at all
    policy = load_policy([ROOT / "policies"])
    with pytest.raises(ValueError, match=re.escape(message)):
        bootstrap(policy, protocol="grpc", upstream=("127.0.0.1", 8080), access_log="always", **{option: value})


def test_the_http_edge_reads_the_trace_headers_the_filter_is_told_to_send() -> None:
    # one list: a trace header the server starts reading reaches it only if Envoy sends it
    from extauthz.envoy import headers
    from extauthz.server import http

    assert http.TRACE_HEADERS is headers.TRACE_HEADERS
    assert set(headers.TRACE_HEADERS) <= set(headers.allowed_headers((), "http"))
