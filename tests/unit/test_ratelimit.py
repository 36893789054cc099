"""``extauthz envoy-config --protocol ratelimit`` (extauthz/envoy/ratelimit.py): the rate limit
actions each descriptor shape needs, the domain, refusals (a real Envoy validates the configs:
tests/e2e/test_ratelimit_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.envoy.ratelimit import bootstrap, rate_limits

from .helpers import policy_from


def limiter(name: str, domain: str, *entries: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "type": "quota", "limit": 5, "period": "minute",
            "match": {"domain": domain, "descriptor": list(entries)}}


def test_one_rate_limit_entry_per_shape_with_an_action_per_entry(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [
        limiter("ip", "edge", {"key": "remote_address"}),
        limiter("ip-one", "edge", {"key": "remote_address", "value": "10.0.0.1"}),  # the same shape's action
        limiter("search", "edge", {"key": "generic_key", "value": "search"}, {"key": "api_key"}),
        limiter("path", "edge", {"key": "path"}, {"key": "destination_cluster"}),
        limiter("other", "other", {"key": "user_id"}),
    ]})
    assert rate_limits(p, "edge", {"api_key": "x-api-key"}) == [
        {"actions": [{"remote_address": {}}]},
        {"actions": [{"generic_key": {"descriptor_value": "search"}},
                     {"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}]},
        {"actions": [{"request_headers": {"header_name": ":path", "descriptor_key": "path"}},
                     {"destination_cluster": {}}]},
    ]
    assert rate_limits(p, "other", {}) == [
        {"actions": [{"request_headers": {"header_name": "user-id", "descriptor_key": "user_id"}}]}]
    with pytest.raises(ValueError, match=r"2 domains \(edge, other\): pick one with --domain"):
        bootstrap(p, upstream=("127.0.0.1", 8080))
    with pytest.raises(ValueError, match="--domain 'nope': no limiter with 'match' has it"):
        bootstrap(p, upstream=("127.0.0.1", 8080), domain="nope")


def test_the_filter_fails_open_and_ext_authz_can_run_before_it(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [limiter("ip", "edge", {"key": "remote_address"})]})
    config = bootstrap(p, upstream=("127.0.0.1", 8080), ext_authz=("10.0.0.5", 9000))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_authz", "envoy.filters.http.ratelimit", "envoy.filters.http.router"]
    rl = hcm["http_filters"][1]["typed_config"]
    assert (rl["domain"], rl["failure_mode_deny"]) == ("edge", False)
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["extauthz", "auth_service", "upstream"]


def test_a_generic_key_without_a_value_is_refused(tmp_path: Path) -> None:
    p = policy_from(tmp_path, {"limiters": [limiter("g", "edge", {"key": "generic_key"})]})
    with pytest.raises(ValueError, match="a 'generic_key' entry needs its value"):
        bootstrap(p, upstream=("127.0.0.1", 8080))


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"version": 1, "limiters": [limiter("k", "edge", {"key": "api_key"})]}))
    assert main(["envoy-config", "--policies", str(f), "--protocol", "ratelimit", "--upstream", "127.0.0.1:8080",
                 "--descriptor-header", "api_key=X-Api-Key"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    vhost = out["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]
    assert vhost["rate_limits"] == [{"actions": [{"request_headers": {"header_name": "x-api-key",
                                                                      "descriptor_key": "api_key"}}]}]
    assert main(["envoy-config", "--policies", str(f), "--protocol", "ratelimit", "--upstream", "127.0.0.1:8080",
                 "--descriptor-header", "api_key"]) == 2
    assert "--descriptor-header: KEY=HEADER, not 'api_key'" in capsys.readouterr().err
    assert main(["envoy-config", "--policies", str(f), "--protocol", "grpc", "--upstream", "127.0.0.1:8080",
                 "--domain", "edge"]) == 2
    assert "are for --protocol ratelimit" in capsys.readouterr().err


def test_the_tier_entry_by_a_generic_key_or_the_routes_metadata(tmp_path: Path) -> None:
    def shedder(*entries: dict[str, str]) -> dict[str, Any]:
        return {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
                "match": {"domain": "edge", "descriptor": list(entries)}}

    p = policy_from(tmp_path, {"classification": {"route_metadata": {"namespace": "acme", "path": ["rl", "tier"]}},
                               "limiters": [shedder({"key": "tier"})]})
    assert rate_limits(p, "edge", {}) == [{"actions": [{"metadata": {
        "descriptor_key": "tier", "source": "ROUTE_ENTRY", "default_value": "post",
        "metadata_key": {"key": "acme", "path": [{"key": "rl"}, {"key": "tier"}]}}}]}]
    p = policy_from(tmp_path, {"classification": {"descriptor_key": "class"},
                               "limiters": [shedder({"key": "class", "value": "critical"}, {"key": "api_key"})]})
    assert rate_limits(p, "edge", {}) == [{"actions": [
        {"generic_key": {"descriptor_key": "class", "descriptor_value": "critical"}},
        {"request_headers": {"header_name": "api-key", "descriptor_key": "api_key"}}]}]
    p = policy_from(tmp_path, {"limiters": [shedder({"key": "tier", "value": "urgent"})]})
    with pytest.raises(ValueError, match="the tier entry 'tier: urgent' names no tier"):
        rate_limits(p, "edge", {})
    p = policy_from(tmp_path, {"classification": {"route_metadata": {"namespace": "acme", "path": ["tiers", 0]}},
                               "limiters": [shedder({"key": "tier"})]})
    with pytest.raises(ValueError, match="a rate limit metadata action follows keys only"):
        rate_limits(p, "edge", {})


@pytest.mark.parametrize(("spec", "logged"), [
    ({"type": "concurrent_requests", "limit": 2}, True),
    ({"type": "fleet_usage", "capacity": 10}, True),
    ({"type": "worker_utilization", "signal": {"source": "inflight", "capacity": 4}}, True),  # count-only leases
    ({"type": "worker_utilization", "signal": {"source": "redis"}}, False),
    ({"type": "quota", "limit": 5, "period": "minute"}, False),
])
def test_the_access_log_that_releases_leases_only_where_a_limiter_takes_them(
        tmp_path: Path, spec: dict[str, Any], logged: bool) -> None:
    p = policy_from(tmp_path, {"limiters": [
        {"name": "l", **spec, "match": {"domain": "edge", "descriptor": [{"key": "tier"}]}},
        # a Check limiter that takes leases does not count: the ratelimit filter never reaches it
        {"name": "checked", "type": "concurrent_requests", "limit": 1}]})
    hcm = bootstrap(p, upstream=("127.0.0.1", 8080))["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    logs = hcm.get("access_log", [])
    assert [log["name"] for log in logs] == (["envoy.access_loggers.http_grpc"] if logged else [])
    if logged:
        assert logs[0]["typed_config"]["common_config"]["grpc_service"] == {"envoy_grpc": {"cluster_name": "extauthz"}}
