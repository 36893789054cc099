"""The rate limit quota filter's rendering (extauthz/envoy/rlqs.py) and its hook in
``extauthz envoy-config`` (the real Envoy validates and runs it: tests/e2e/test_rlqs_envoy.py)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.core.context import RawRequest
from extauthz.engine.quota_service import classification_id
from extauthz.envoy.config import bootstrap
from extauthz.envoy.rlqs import quota_filters
from extauthz.policy import load_policy
from extauthz.policy.classify import Classifier

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


def _matchers(f: dict[str, Any]) -> list[dict[str, Any]]:
    """A quota filter's own matchers, under the one that leaves Envoy's health route out."""
    (outer,) = f["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    assert "not_matcher" in outer["predicate"]
    matchers: list[dict[str, Any]] = outer["on_match"]["matcher"]["matcher_list"]["matchers"]
    return matchers


def _settings(f: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (matcher,) = _matchers(f)
    return matcher["predicate"], matcher["on_match"]["action"]["typed_config"]


def _bucket(f: dict[str, Any], method: str, path: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The settings of the bucket Envoy's matcher tree gives a request (None: no bucket,
    the filter lets it pass), first match wins at each level."""
    matchers = f["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    while True:
        first = next((m for m in matchers if _holds(m["predicate"], method, path, headers)), None)
        if first is None:
            return None
        if "matcher" not in first["on_match"]:
            settings: dict[str, Any] = first["on_match"]["action"]["typed_config"]
            return settings
        matchers = first["on_match"]["matcher"]["matcher_list"]["matchers"]


def test_one_filter_per_envoy_limiter_with_its_bucket_id_and_matchers(tmp_path: Path) -> None:
    key, ip = quota_filters(_policy(tmp_path), "extauthz")
    assert [key["name"], ip["name"]] == ["extauthz.rlqs.key-rate", "extauthz.rlqs.ip-rate"]
    assert key["typed_config"]["rlqs_server"] == {"envoy_grpc": {"cluster_name": "extauthz"}}
    # a method key part: one matcher per method of applies_to names it in the bucket id
    get, get_shared, post, _ = _matchers(key)
    settings = get["on_match"]["action"]["typed_config"]
    builder = settings["bucket_id_builder"]["bucket_id_builder"]
    assert builder["limiter"] == {"string_value": "key-rate"}
    assert builder["header:x-api-key"]["custom_value"]["typed_config"]["header_name"] == "x-api-key"
    assert builder["method"] == {"string_value": "GET"}
    assert post["on_match"]["action"]["typed_config"]["bucket_id_builder"]["bucket_id_builder"]["method"] == {
        "string_value": "POST"}
    method, scope = get["predicate"]["and_matcher"]["predicate"]
    assert method["single_predicate"]["value_match"] == {"exact": "GET", "ignore_case": True}
    path, methods, present = scope["and_matcher"]["predicate"]
    assert path["single_predicate"]["value_match"] == {"prefix": "/v1/"}
    exact = [p["single_predicate"]["value_match"]["exact"] for p in methods["or_matcher"]["predicate"]]
    assert exact == ["GET", "POST"]
    assert present["single_predicate"]["input"]["typed_config"]["header_name"] == "x-api-key"
    assert present["single_predicate"]["value_match"]["safe_regex"]["regex"] == "[^,]+"
    # a key header with a comma (repeated): one bucket for all such requests
    shared = get_shared["on_match"]["action"]["typed_config"]["bucket_id_builder"]["bucket_id_builder"]
    assert shared["header:x-api-key"] == {"string_value": ","} and shared["method"] == {"string_value": "GET"}
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


# -- shedders pushed to Envoy (envoy_deny_all)

SHED_POLICY = """version: 1
identity: [{header: x-api-key}]
test_mode: {header: X-Test}
classification:
  rules:
    - {match: {path_prefix: /v1/charges, methods: [POST, PUT]}, tier: critical}
    - {match: {headers: {x-batch: "yes"}}, tier: test}
    - {match: {path_prefix: /v1/search}, tier: post}
limiters:
  - {name: workers, type: worker_utilization, signal: {source: redis}, sample_interval: 2.5s,
     envoy_deny_all: true}
"""


def _holds(predicate: dict[str, Any], method: str, path: str, headers: dict[str, str]) -> bool:
    """Envoy's matcher semantics for the predicate shapes the generator writes."""
    if "not_matcher" in predicate:
        return not _holds(predicate["not_matcher"], method, path, headers)
    if "and_matcher" in predicate:
        return all(_holds(p, method, path, headers) for p in predicate["and_matcher"]["predicate"])
    if "or_matcher" in predicate:
        return any(_holds(p, method, path, headers) for p in predicate["or_matcher"]["predicate"])
    single = predicate["single_predicate"]
    name = single["input"]["typed_config"]["header_name"]
    value = {":method": method, ":path": path}.get(name, headers.get(name))
    if value is None:
        return False
    match = single["value_match"]
    if match.get("ignore_case"):  # Envoy's StringMatcher: ASCII case folded on both sides
        value, match = value.lower(), {k: v.lower() if isinstance(v, str) else v for k, v in match.items()}
    if "prefix" in match:
        return bool(value.startswith(match["prefix"]))
    if "exact" in match:
        return bool(value == match["exact"])
    return re.fullmatch(match["safe_regex"]["regex"], value) is not None  # RE2 matches whole values


def test_a_shedder_s_filter_buckets_requests_by_the_classifier_s_tier(tmp_path: Path) -> None:
    """Its matchers, read with Envoy's semantics, put every request in the bucket of the tier
    the server's classifier gives it (the whole cross product of methods, paths, headers)."""
    policy = _policy(tmp_path, SHED_POLICY)
    (shed,) = quota_filters(policy, "extauthz")
    assert shed["name"] == "extauthz.rlqs-shed.workers"
    classifier = Classifier(policy)
    rendered = classification_id(policy)
    seen = set()
    # methods in any case: HTTP/2 carries ``post`` as it is, the classifier upper-cases it
    for method in ("GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "get", "Head", "post", "put"):
        for path in ("/", "/v1/charges", "/v1/charges/ch_1", "/v1/search?q=1", "/v2/x"):
            for test in (None, "true", "TRUE", "false"):
                for batch in (None, "yes", "no"):
                    headers = {"x-api-key": "sk_live_1"}
                    if test is not None:
                        headers["x-test"] = test
                    if batch is not None:
                        headers["x-batch"] = batch
                    tier = classifier.context(RawRequest(method, path, headers=headers)).tier.value
                    settings = _bucket(shed, method, path, headers)
                    assert settings is not None, (method, path, headers)
                    bucket = settings["bucket_id_builder"]["bucket_id_builder"]
                    assert bucket == {"shedder": {"string_value": "workers"}, "tier": {"string_value": tier},
                                      "classification": {"string_value": rendered}}, (method, path, headers)
                    seen.add(tier)
    assert seen == {"critical", "post", "get", "test"}


def test_a_shedder_s_filter_allows_without_an_assignment_and_refuses_with_the_shedder_s_problem(
        tmp_path: Path) -> None:
    (shed,) = quota_filters(_policy(tmp_path, SHED_POLICY), "extauthz")
    for matcher in _matchers(shed):
        settings = matcher["on_match"]["action"]["typed_config"]
        tier = settings["bucket_id_builder"]["bucket_id_builder"]["tier"]["string_value"]
        # a server away lifts the push (the check's shedder goes on): never DENY_ALL by default
        assert settings["no_assignment_behavior"] == {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}}
        assert settings["expired_assignment_behavior"] == {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}}
        deny = settings["deny_response_settings"]
        assert deny["http_status"] == {"code": "ServiceUnavailable"}
        body = json.loads(base64.b64decode(deny["http_body"]))
        assert (body["type"], body["status"], body["limiter"], body["tier"], body["retry_after"]) == (
            f"urn:extauthz:problem:shedding_{tier}", 503, "workers", tier, 3)
        assert {"key": "retry-after", "value": "3"} in [h["header"] for h in deny["response_headers_to_add"]]


def test_check_policies_says_which_shedders_push_deny_all_to_envoy(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.commands.cli import main

    (tmp_path / "api.yaml").write_text(SHED_POLICY)
    assert main(["check-policies", str(tmp_path)]) == 0
    assert "workers (worker_utilization, enforce, DENY_ALL in envoy)" in capsys.readouterr().out


def test_rlqs_with_only_a_pushed_shedder_renders_its_filter_first(tmp_path: Path) -> None:
    both = SHED_POLICY + "  - {name: ip-rate, type: request_rate, rate: 5, burst: 10, key: [{source_ip: true}], " \
                         "enforce: envoy}\n"
    names = [f["name"] for f in quota_filters(_policy(tmp_path, both), "extauthz")]
    assert names == ["extauthz.rlqs-shed.workers", "extauthz.rlqs.ip-rate"]
    config = bootstrap(_policy(tmp_path, SHED_POLICY), protocol="grpc", upstream=("127.0.0.1", 8080), rlqs=True)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert "extauthz.rlqs-shed.workers" in [f["name"] for f in manager["http_filters"]]


def test_several_authz_put_every_replica_in_the_one_grpc_cluster(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``envoy-config --authz A --authz B``: the quota stream (and the checks) may reach either
    replica; Envoy opens the stream again on the other when its own goes."""
    from extauthz.commands.cli import main

    _policy(tmp_path)
    base = ["envoy-config", "--policies", str(tmp_path), "--upstream", "127.0.0.1:8080", "--rlqs"]
    assert main([*base, "--protocol", "grpc", "--authz", "10.0.0.1:9001", "--authz", "10.0.0.2:9001"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    endpoints = clusters["extauthz"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"]) for e in endpoints] == [
        ("10.0.0.1", 9001), ("10.0.0.2", 9001)]
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    quota = [f for f in manager["http_filters"] if f["name"].startswith("extauthz.rlqs.")]
    assert {f["typed_config"]["rlqs_server"]["envoy_grpc"]["cluster_name"] for f in quota} == {"extauthz"}
    assert main([*base, "--protocol", "http", "--authz", "10.0.0.1:9003", "--authz", "10.0.0.2:9003"]) == 2
    assert "several --authz are for --protocol grpc" in capsys.readouterr().err
    assert main([*base, "--protocol", "grpc", "--authz", "10.0.0.1:9001", "--authz", "extauthz:9001"]) == 2
    assert "all addresses or all host names" in capsys.readouterr().err


def test_a_limiter_s_methods_match_in_envoy_in_any_case_as_in_the_check(tmp_path: Path) -> None:
    """``applies_to.methods`` holds for ``post`` (HTTP/2 carries a method's case as sent) in
    Envoy as in the check, which upper-cases it: else a request in lower case is outside the
    limiter in Envoy, and the check no longer counts it (it is Envoy's)."""
    policy = _policy(tmp_path)
    key, _ = quota_filters(policy, "extauthz")
    applies = next(s for s in policy.limiters if s.name == "key-rate").applies_to
    for method in ("GET", "post", "Post", "get", "PUT", "delete"):
        held = _bucket(key, method, "/v1/x", {"x-api-key": "k"}) is not None
        assert held == (method.upper() in (applies.methods or ())), method


def test_quickstart_routes_are_refused_with_a_pushed_shedder(tmp_path: Path) -> None:
    """The quick start's routes name their tiers in route metadata and context extensions,
    which the quota filter cannot read: POST /v1/charges, critical in the check, would be in
    Envoy's post bucket and refused there while post is shed whole."""
    policy = _policy(tmp_path, SHED_POLICY)
    for protocol in ("grpc", "http"):
        with pytest.raises(ValueError, match="--quickstart-routes with --rlqs: the shedder workers pushes DENY_ALL"):
            bootstrap(policy, protocol=protocol, upstream=("127.0.0.1", 8080), rlqs=True, quickstart_routes=True)
        # without the push (no --rlqs) the routes are as before: the check sheds alone
        bootstrap(policy, protocol=protocol, upstream=("127.0.0.1", 8080), quickstart_routes=True)


def test_envoy_s_health_route_is_in_no_quota_bucket(tmp_path: Path) -> None:
    """``/healthz`` is answered by Envoy without a check (the check's shedder and limiters
    never see it): no quota filter buckets it, so a tier shed whole or a limiter's empty
    bucket never fails a load balancer's probe; ``/healthzx`` and ``/v1/healthz`` are
    checked routes and bucketed as the check classifies them."""
    both = SHED_POLICY + "  - {name: ip-rate, type: request_rate, rate: 5, burst: 10, key: [{source_ip: true}], " \
                         "enforce: envoy}\n"
    shed, ip = quota_filters(_policy(tmp_path, both), "extauthz")
    for f in (shed, ip):
        for path in ("/healthz", "/healthz?full=1"):
            assert _bucket(f, "GET", path, {}) is None, (f["name"], path)
        for path in ("/healthzx", "/v1/healthz", "/"):
            assert _bucket(f, "GET", path, {}) is not None, (f["name"], path)
    settings = _bucket(shed, "GET", "/healthzx", {})
    assert settings is not None and settings["bucket_id_builder"]["bucket_id_builder"]["tier"] == {
        "string_value": "get"}


@pytest.mark.parametrize(("authz", "more", "tls", "message"), [
    (("10.0.0.1", 9001), (("10.0.0.1", 9001),), False, "the server endpoint 10.0.0.1:9001 is given twice"),
    (("a.svc", 9001), (("b.svc", 9001), ("a.svc", 9001)), False, "the server endpoint a.svc:9001 is given twice"),
    (("10.0.0.1", 9001), tuple(("10.0.0.1", 9002 + i) for i in range(64)), False,
     "at most 64 server endpoints (--authz), not 65"),
    (("10.0.0.1", 9001), (("10.0.0.2", 0),), False, "a port in 1-65535, not 10.0.0.2:0"),
    (("10.0.0.1", 9001), (("", 9001),), False, "a port in 1-65535, not :9001"),
    (("a.svc", 9001), (("b.svc", 9001),), True,
     "with TLS the server's endpoints share one host name (the certificate each must show, checked as 'a.svc'), "
     "not a.svc, b.svc"),
])
def test_several_authz_are_bounded_each_once_and_one_tls_name(
        tmp_path: Path, authz: tuple[str, int], more: tuple[tuple[str, int], ...], tls: bool, message: str) -> None:
    """A repeated endpoint would double its replica's share silently; with TLS the cluster
    checks every endpoint's certificate against the first host name, so a second name would
    fail every handshake to that replica and its checks would fail open."""
    from extauthz.envoy.blocks import TlsFiles

    policy = _policy(tmp_path, SHED_POLICY)
    files = TlsFiles("c.pem", "k.pem", "ca.pem") if tls else None
    with pytest.raises(ValueError) as caught:
        bootstrap(policy, protocol="grpc", upstream=("127.0.0.1", 8080), rlqs=True, authz=authz,
                  authz_more=more, tls=files)
    assert message in str(caught.value)


def test_several_authz_with_tls_on_one_name_or_on_addresses_render(tmp_path: Path) -> None:
    from extauthz.envoy.blocks import TlsFiles

    policy = _policy(tmp_path, SHED_POLICY)
    files = TlsFiles("c.pem", "k.pem", "ca.pem")
    for authz, more, name in ((("extauthz.svc", 9001), (("extauthz.svc", 9002),), "extauthz.svc"),
                              (("10.0.0.1", 9001), (("10.0.0.2", 9001),), "extauthz")):
        config = bootstrap(policy, protocol="grpc", upstream=("127.0.0.1", 8080), rlqs=True, authz=authz,
                           authz_more=more, tls=files)
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "extauthz"]
        assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
        assert cluster["transport_socket"]["typed_config"]["sni"] == name  # one socket: every endpoint


def test_the_classification_id_follows_what_the_matchers_read(tmp_path: Path) -> None:
    """The digest a shedder's buckets carry changes with every tier source its matchers read
    (a rule's methods, path, headers or tier, their order, the test header), and not with
    anything else (a limiter's numbers): a reload of the latter leaves Envoy's push on."""
    base = classification_id(_policy(tmp_path, SHED_POLICY))
    same = SHED_POLICY.replace("sample_interval: 2.5s", "sample_interval: 4s")
    assert classification_id(_policy(tmp_path, same)) == base
    changed = [
        SHED_POLICY.replace("methods: [POST, PUT]", "methods: [POST]"),
        SHED_POLICY.replace("path_prefix: /v1/search", "path_prefix: /v1/find"),
        SHED_POLICY.replace('x-batch: "yes"', 'x-batch: "no"'),
        SHED_POLICY.replace("tier: post}", "tier: critical}"),
        SHED_POLICY.replace("header: X-Test", "header: X-Sandbox"),
        SHED_POLICY.replace("    - {match: {headers: {x-batch: \"yes\"}}, tier: test}\n", ""),
        SHED_POLICY.replace("    - {match: {path_prefix: /v1/search}, tier: post}\n", "").replace(
            "  rules:\n", "  rules:\n    - {match: {path_prefix: /v1/search}, tier: post}\n"),  # order
    ]
    ids = {classification_id(_policy(tmp_path, text)) for text in changed}
    assert all(text != SHED_POLICY for text in changed)
    assert len(ids) == len(changed) and base not in ids


def test_a_shedder_s_filter_name_is_never_a_limiter_s(tmp_path: Path) -> None:
    """Names may hold dots: a limiter named ``shed.workers`` beside the shedder ``workers``
    had the shedder's filter name (Envoy takes two filters of one name without a word)."""
    both = SHED_POLICY + "  - {name: shed.workers, type: request_rate, rate: 5, burst: 10, " \
                         "key: [{source_ip: true}], enforce: envoy}\n"
    names = [f["name"] for f in quota_filters(_policy(tmp_path, both), "extauthz")]
    assert names == ["extauthz.rlqs-shed.workers", "extauthz.rlqs.shed.workers"]


def test_a_method_key_part_is_one_bucket_per_method_in_any_case(tmp_path: Path) -> None:
    """The check keys ``get``, ``gEt`` and ``GET`` as GET (upper-cased); Envoy's ``:method``
    keeps the case (HTTP/2 passes ``gEt`` on), so a bucket id built from it made a bucket per
    spelling, each with the limiter's whole rate. The matcher that matches names the method
    instead; methods beyond RFC 9110's and PATCH share one bucket (``other``: stricter than
    the check, never looser)."""
    text = POLICY + "  - {name: m-rate, type: request_rate, rate: 1, burst: 2, key: [{method: true}], " \
                    "enforce: envoy}\n"
    key, _, m = quota_filters(_policy(tmp_path, text), "extauthz")

    def method_of(f: dict[str, Any], method: str) -> str | None:
        settings = _bucket(f, method, "/v1/x", {"x-api-key": "k"})
        return None if settings is None else settings["bucket_id_builder"]["bucket_id_builder"]["method"][
            "string_value"]

    for spelling in ("GET", "get", "gEt", "Get"):
        assert method_of(m, spelling) == "GET", spelling
        assert method_of(key, spelling) == "GET", spelling
    for spelling in ("delete", "DELETE", "Patch", "options"):
        assert method_of(m, spelling) == spelling.upper(), spelling
        assert method_of(key, spelling) is None, spelling  # outside applies_to.methods
    for spelling in ("PROPFIND", "propfind", "MKCOL"):
        assert method_of(m, spelling) == "other", spelling


def test_a_key_header_with_a_comma_is_one_shared_bucket_in_envoy(tmp_path: Path) -> None:
    """The check reads ``k,k`` (a header repeated) as k and ``k,j`` as one ambiguous value;
    Envoy reads a value whole, so ``k,k``, ``k,k,k``... were each a bucket of their own with the
    limiter's whole rate: a client multiplied its limit by repeating its key. Every such
    request shares one bucket in Envoy (stricter than the check, never looser)."""
    key, _ = quota_filters(_policy(tmp_path), "extauthz")

    def header_of(value: str) -> dict[str, Any] | None:
        settings = _bucket(key, "GET", "/v1/x", {"x-api-key": value})
        return None if settings is None else settings["bucket_id_builder"]["bucket_id_builder"]["header:x-api-key"]

    plain = header_of("k")
    assert plain is not None and "custom_value" in plain  # the value itself
    for value in ("k,k", "k,k,k", "k, j", "k,"):
        assert header_of(value) == {"string_value": ","}, value
    assert _bucket(key, "GET", "/v1/x", {}) is None  # no key: not limited (on_missing_key: skip)
