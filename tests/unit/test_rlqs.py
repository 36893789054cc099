"""The rate limit quota filter's rendering (extauthz/envoy/rlqs.py) and its hook in
``extauthz envoy-config`` (the real Envoy validates and runs it: tests/e2e/test_rlqs_envoy.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from extauthz.envoy.config import bootstrap
from extauthz.envoy.rlqs import quota_filters
from extauthz.policy import load_policy

POLICY = """version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: key-rate, type: request_rate, rate: 0.5, burst: 3, cost: 1, enforce: envoy,
     key: [{header: X-Api-Key}, {method: true}], applies_to: {path_prefix: /v1/, methods: [GET, POST]}}
  - {name: ip-rate, type: request_rate, rate: 5, burst: 10, key: [{source_ip: true}], enforce: envoy}
  - {name: user-rate, type: request_rate, rate: 1, burst: 2}
"""


def _policy(tmp_path: Path, text: str = POLICY) -> Any:
    (tmp_path / "api.yaml").write_text(text)
    return load_policy([tmp_path])


def _settings(f: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (matcher,) = f["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    return matcher["predicate"], matcher["on_match"]["action"]["typed_config"]


def test_one_filter_per_envoy_limiter_with_its_bucket_id_and_matchers(tmp_path: Path) -> None:
    key, ip = quota_filters(_policy(tmp_path), "extauthz")
    assert [key["name"], ip["name"]] == ["extauthz.rlqs.key-rate", "extauthz.rlqs.ip-rate"]
    assert key["typed_config"]["rlqs_server"] == {"envoy_grpc": {"cluster_name": "extauthz"}}
    predicate, settings = _settings(key)
    builder = settings["bucket_id_builder"]["bucket_id_builder"]
    assert builder["limiter"] == {"string_value": "key-rate"}
    assert builder["header:x-api-key"]["custom_value"]["typed_config"]["header_name"] == "x-api-key"
    assert builder["method"]["custom_value"]["typed_config"]["header_name"] == ":method"
    path, methods, present = predicate["and_matcher"]["predicate"]
    assert path["single_predicate"]["value_match"] == {"prefix": "/v1/"}
    exact = [p["single_predicate"]["value_match"]["exact"] for p in methods["or_matcher"]["predicate"]]
    assert exact == ["GET", "POST"]
    assert present["single_predicate"]["input"]["typed_config"]["header_name"] == "x-api-key"
    # never allow-all before or after an assignment; the refusal is ours
    deny = {"fallback_rate_limit": {"blanket_rule": "DENY_ALL"}}
    assert settings["no_assignment_behavior"] == deny and settings["expired_assignment_behavior"] == deny
    body = json.loads(base64.b64decode(settings["deny_response_settings"]["http_body"]))
    assert body["limiter"] == "key-rate" and body["status"] == 429
    assert body["retry_after"] == 2  # the fill interval: rate 0.5/s fills one token in 2 s
    # a source_ip-only limiter matches every request
    predicate, settings = _settings(ip)
    assert predicate == {"single_predicate": {"input": {"name": "header::path", "typed_config": {
        "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
        "header_name": ":path"}}, "value_match": {"prefix": "/"}}}
    assert set(settings["bucket_id_builder"]["bucket_id_builder"]) == {"limiter", "source_ip"}


def test_bootstrap_puts_the_quota_filters_before_ext_authz(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    for protocol, cluster in (("grpc", "extauthz"), ("http", "extauthz_rlqs")):
        config = bootstrap(policy, protocol=protocol, upstream=("127.0.0.1", 8080),
                           authz=("authz.local", 9003 if protocol == "http" else 9001), rlqs=True)
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        names = [f["name"] for f in manager["http_filters"]]
        assert names.index("extauthz.rlqs.ip-rate") < names.index("envoy.filters.http.ext_authz")
        types = [f["typed_config"]["@type"] for f in manager["http_filters"] if f["name"].startswith("extauthz.rlqs.")]
        assert types and all(t.endswith("RateLimitQuotaFilterConfig") for t in types)
        clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
        address = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert address["socket_address"] == {"address": "authz.local", "port_value": 9001}  # the gRPC port
        assert "typed_extension_protocol_options" in clusters[cluster]  # HTTP/2


def test_rlqs_needs_envoy_limiters_and_envoy_limiters_need_rlqs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="enforces key-rate, ip-rate in Envoy: add --rlqs"):
        bootstrap(_policy(tmp_path), protocol="grpc", upstream=("127.0.0.1", 8080))
    plain = _policy(tmp_path, "version: 1\nlimiters:\n  - {name: r, type: request_rate, rate: 1, burst: 2}\n")
    with pytest.raises(ValueError, match="no limiter with enforce: envoy"):
        bootstrap(plain, protocol="grpc", upstream=("127.0.0.1", 8080), rlqs=True)


def test_check_policies_says_which_limiters_run_in_envoy(capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.commands.cli import main

    from ..conftest import ROOT

    assert main(["check-policies", str(ROOT / "policies" / "rlqs")]) == 0
    out = capsys.readouterr().out
    assert "ip-rate (request_rate, enforce in envoy)" in out
    assert "user-concurrency (concurrent_requests, enforce)" in out


def test_k8s_refuses_a_policy_with_limiters_in_envoy(capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.commands.cli import main

    from ..conftest import ROOT

    argv = ["k8s", "--policies", str(ROOT / "policies" / "rlqs"), "--target", "istio-sidecar",
            "--selector", "app=api"]
    assert main(argv) == 2
    assert "enforces ip-rate, key-rate in Envoy" in capsys.readouterr().err
