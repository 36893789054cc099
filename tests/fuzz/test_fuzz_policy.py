"""Random YAML text and random policy structures through the one validator: a policy, or
``file:line: path: message`` errors; never another exception."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extauthz.core.errors import PolicyError
from extauthz.policy import Policy, load_policy
from extauthz.policy.loader import parse_file

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ISSUE = re.compile(r"^(?P<file>[^\n]+?):(?P<line>\d+): (?:(?P<path>[A-Za-z0-9_.\[\]-]+): )?(?P<message>\S.*)$", re.S)

# Words the schema knows, so that random structures get past the first unknown key often.
KEYS = ["version", "identity", "header", "strip_prefix", "source_ip", "metadata", "namespace", "path",
        "principal", "equals", "test_mode", "key_prefix", "classification", "rules", "match", "methods",
        "path_prefix", "hosts", "headers", "tier", "limiters", "name", "type", "mode", "rate", "burst",
        "cost", "limit", "lease_ttl", "capacity", "reserved_for_critical", "signal", "source",
        "applies_to", "tiers", "failure_mode", "good_below", "bad_above", "delay_before_shedding",
        "time_to_shed_all", "sample_interval", "route_metadata_namespace", "route_metadata",
        "context_extension_key", "key", "on_missing_key", "period", "host", "route", "context_extension",
        "plan", "identity"]
WORDS = ["request_rate", "concurrent_requests", "quota", "month", "week", "shared", "skip", "fleet_usage",
         "worker_utilization", "enforce", "shadow",
         "off", "critical", "post", "get", "test", "inflight", "redis", "60s", "100/s", "2m", "x-api-key",
         "GET", "/v1/", "open", "closed", "envoy.filters.http.jwt_authn", "payload", "sub"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS), st.text(max_size=20),
)
structures = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=6),
    ),
    max_leaves=30,
)


def _assert_issues(err: PolicyError, file: str) -> None:
    assert err.issues
    for issue in err.issues:
        text = str(issue)
        m = ISSUE.match(text)
        assert m is not None, text
        assert m.group("file") == file and int(m.group("line")) >= 1, text


def _load_text(text: str) -> Policy | PolicyError:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "p.yaml"
        f.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            return load_policy([f])
        except PolicyError as err:
            _assert_issues(err, str(f))
            return err


@SETTINGS
@given(st.text(max_size=300))
def test_random_text(text: str) -> None:
    _load_text(text)


@SETTINGS
@given(st.lists(st.sampled_from([
    "version: 1", "identity:", "  - header: x", "  - metadata: {namespace: n, path: [a]}", "limiters:",
    "  - name: r", "    type: request_rate", "    rate: 1", "    burst: 2", "  - principal: true",
    "&a [1, 2]", "*a", "{", "]", "- ", ": ", "  ", "\t", "? x", "!!binary x", "---", "'", '"\\x"', "#",
    "test_mode: {metadata: {namespace: n, path: [p], equals: false}}",
]), max_size=12))
def test_random_yaml_lines(lines: list[str]) -> None:
    _load_text("\n".join(lines))


@SETTINGS
@given(st.fixed_dictionaries({"version": st.one_of(st.just(1), scalars)}, optional={
    "identity": structures, "test_mode": structures, "classification": structures, "limiters": structures,
}))
def test_random_policy_structures(doc: dict[str, Any]) -> None:
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    result = _load_text(text)
    if isinstance(result, Policy):
        assert result.version and isinstance(result.limiters, tuple)


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_through_parse_file(data: bytes) -> None:
    model, _, issues = parse_file("f.yaml", data.decode("utf-8", "replace"))
    assert (model is None) == bool(issues)
