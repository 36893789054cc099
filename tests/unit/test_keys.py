"""Limiter keys: each key part's value through the classifier (and the gRPC edge for route
metadata), hashing, and the quota's calendar windows in UTC."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.context import RawRequest
from extauthz.limiters.quota import calendar_window
from extauthz.policy.classify import Classifier, hash_identity
from extauthz.proto import auth_pb2
from extauthz.server.edge import raw_request

from .helpers import policy_from

JWT = "envoy.filters.http.jwt_authn"


def keyed(tmp_path: Path, *parts: dict[str, Any], **doc: Any) -> Classifier:
    limiters = [{"name": f"l{i}", "type": "request_rate", "rate": 1, "burst": 1, "key": [part]}
                for i, part in enumerate(parts)]
    return Classifier(policy_from(tmp_path, {"limiters": limiters, **doc}), salt=b"salt")


def request(**kw: Any) -> RawRequest:
    return RawRequest(kw.pop("method", "GET"), "/v1/x", **kw)


def present(c: Classifier, raw: RawRequest) -> list[bool]:
    return [not missing for _, missing in c.context(raw).keys]


def test_each_key_part_yields_its_value_or_nothing(tmp_path: Path) -> None:
    parts = [{"header": "x-org"}, {"header": "authorization", "strip_prefix": "Bearer "}, {"source_ip": True},
             {"principal": True}, {"metadata": {"namespace": JWT, "path": ["payload", "org"]}},
             {"method": True}, {"host": True}, {"context_extension": "team"}, {"plan": True}]
    c = keyed(tmp_path, *parts, plan={"from": [{"header": "x-plan"}], "default": "free"},
              identity=[{"header": "x-api-key"}])
    full = request(host="API.example.com:8443", headers={"x-org": "acme", "authorization": "Bearer t1",
                                                         "x-api-key": "k"},
                   source_ip="10.0.0.1", principal="spiffe://a", metadata={JWT: {"payload": {"org": 42.0}}},
                   context_extensions={"team": "blue"})
    assert present(c, full) == [True] * 9
    bare = request(host="", headers={"authorization": "Basic x"})
    # nothing but the method and the plan (its default)
    assert present(c, bare) == [False, False, False, False, False, True, False, False, True]


def test_key_values_are_keyed_hashes_of_what_and_which(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"host": True}, {"header": "x-host"})
    a = c.context(request(host="api.example.com", headers={"x-host": "api.example.com"}))
    (host_key, _), (header_key, _) = a.keys
    assert len(host_key) == 24 and host_key != header_key  # the same value, another part
    assert "api.example.com" not in repr(a.keys)
    same = c.context(request(host="API.example.com:443", headers={"x-host": "api.example.com"}))
    assert same.keys[0] == a.keys[0]  # without port, lower case
    other_salt = Classifier(c._policy, salt=b"other")
    assert other_salt.context(request(host="api.example.com")).keys[0][0] != host_key


def test_parts_are_combined_without_ambiguity(tmp_path: Path) -> None:
    c = Classifier(policy_from(tmp_path, {"limiters": [{
        "name": "two", "type": "request_rate", "rate": 1, "burst": 1,
        "key": [{"header": "x-a"}, {"header": "x-b"}]}]}))
    ab = c.context(request(headers={"x-a": "ab", "x-b": "c"})).keys[0][0]
    a_bc = c.context(request(headers={"x-a": "a", "x-b": "bc"})).keys[0][0]
    assert ab != a_bc


def test_a_missing_part_is_the_key_s_shared_bucket(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"header": "x-org"}, {"header": "x-team"})
    (org, org_missing), (team, team_missing) = c.context(request()).keys
    assert org_missing and team_missing and org != team  # one shared bucket per key
    assert org == hash_identity("", "key:header:x-org:missing", b"salt")


def test_limiters_with_the_same_key_share_one_value(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"header": "x-org"}, {"header": "x-org"}, {"identity": True})
    assert len(c.context(request(headers={"x-org": "acme"})).keys) == 1  # identity: no key of its own


def route_check(route: dict[str, dict[str, Any]], extensions: dict[str, str] | None = None) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    req.attributes.request.http.method = "GET"
    for ns, value in route.items():
        req.attributes.route_metadata_context.filter_metadata[ns].update(value)
    req.attributes.context_extensions.update(extensions or {})
    return req


def test_route_and_route_metadata_parts_through_the_grpc_edge(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"route": True}, {"route_metadata": {"namespace": "envoy-gateway",
                                                             "path": ["resources", 0, "name"]}},
              classification={"route_metadata_namespace": "mine"})
    policy = c._policy

    def keys(req: auth_pb2.CheckRequest) -> tuple[tuple[str, bool], ...]:
        raw = raw_request(req, c.needed_headers, policy.needed_route_metadata, c.needed_metadata)
        return c.context(raw).keys

    assert policy.needed_route_metadata == (("mine", ("tier",)), ("mine", ("route",)),
                                            ("envoy-gateway", ("resources", 0, "name")))
    by_metadata = keys(route_check({"mine": {"route": "search"},
                                    "envoy-gateway": {"resources": [{"name": "shop"}]}}))
    by_extension = keys(route_check({}, {"route": "search"}))
    assert by_metadata[0] == by_extension[0] and not by_metadata[0][1]  # the same route's name
    assert not by_metadata[1][1] and by_extension[1][1]  # no resources: missing
    assert keys(route_check({"mine": {"route": "other"}}))[0] != by_metadata[0]


@pytest.mark.parametrize(("period", "at", "start", "end"), [
    ("second", "2026-03-04T10:20:30", "2026-03-04T10:20:30", "2026-03-04T10:20:31"),
    ("minute", "2026-03-04T10:20:30", "2026-03-04T10:20:00", "2026-03-04T10:21:00"),
    ("hour", "2026-03-04T10:20:30", "2026-03-04T10:00:00", "2026-03-04T11:00:00"),
    ("day", "2026-03-04T23:59:59", "2026-03-04T00:00:00", "2026-03-05T00:00:00"),
    ("week", "2026-03-04T10:00:00", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),  # Wed -> Mon
    ("week", "2026-03-02T00:00:00", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),  # Monday itself
    ("week", "2026-03-08T23:59:59", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),  # Sunday
    ("month", "2026-12-31T23:59:59", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
    ("month", "2028-02-29T12:00:00", "2028-02-01T00:00:00", "2028-03-01T00:00:00"),  # leap year
    ("month", "2026-02-01T00:00:00", "2026-02-01T00:00:00", "2026-03-01T00:00:00"),
    ("year", "2026-12-31T23:59:59", "2026-01-01T00:00:00", "2027-01-01T00:00:00"),
    ("year", "2028-01-01T00:00:00", "2028-01-01T00:00:00", "2029-01-01T00:00:00"),  # 366 days
])
def test_calendar_windows_in_utc(period: str, at: str, start: str, end: str) -> None:
    def ts(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()

    assert calendar_window(period, ts(at) + 0.25) == (int(ts(start)), int(ts(end)))


def test_header_values_are_trimmed_and_a_repeat_of_one_value_is_that_value(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"header": "x-org"}, identity=[{"header": "x-api-key"}])
    acme = c.context(request(headers={"x-org": "acme", "x-api-key": "k"}))
    for org, key in ((" acme\t", "k "), ("acme,acme", "k,k"), ("acme, ,acme ", " k, k")):
        same = c.context(request(headers={"x-org": org, "x-api-key": key}))
        assert (same.keys, same.identity) == (acme.keys, acme.identity), org
    # no case folding unless asked: API keys and names stay case-sensitive
    upper = c.context(request(headers={"x-org": "ACME", "x-api-key": "K"}))
    assert upper.keys != acme.keys and upper.identity != acme.identity


def test_different_values_of_a_repeated_header_share_one_bucket(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"header": "x-org"}, identity=[{"header": "x-api-key"}, {"source_ip": True}])
    acme = c.context(request(headers={"x-org": "acme", "x-api-key": "k"}))
    one = c.context(request(headers={"x-org": "acme,other", "x-api-key": "k,j"}))
    two = c.context(request(headers={"x-org": "x, y", "x-api-key": "a,b"}, source_ip="10.0.0.1"))
    assert one.keys == two.keys and not one.keys[0][1]  # counted (not skipped), in one bucket
    assert one.keys != acme.keys
    assert one.identity == two.identity != acme.identity
    assert two.identity_source == "header:x-api-key"  # not the next rule: a client cannot pick


def test_case_fold_is_chosen_per_key_part(tmp_path: Path) -> None:
    jwt = {"metadata": {"namespace": JWT, "path": ["payload", "org"]}}
    c = keyed(tmp_path, {"header": "x-org", "case": "fold"}, {"header": "x-org"},
              {"context_extension": "team", "case": "fold"}, {**jwt, "case": "fold"})

    def keys(org: str) -> tuple[tuple[str, bool], ...]:
        return c.context(request(headers={"x-org": org}, context_extensions={"team": org},
                                 metadata={JWT: {"payload": {"org": org}}})).keys

    folded, kept = keys("ACME"), keys("acme")
    assert folded[0] == kept[0] and folded[2:] == kept[2:]  # the parts with case: fold
    assert folded[1] != kept[1]  # the one without
    assert keys("Acme, ACME")[0] == kept[0]  # a repeat compared after folding


@pytest.mark.parametrize(("host", "same_as"), [
    ("[::1]:8080", "[::1]"), ("[0:0::1]", "[::1]"), ("::1", "[::1]"), ("[::A]", "[::a]"),
    ("API.Example.COM:443", "api.example.com"), ("api.example.com.", "api.example.com"),
    ("10.0.0.1:80", "10.0.0.1"),
])
def test_the_host_part_is_the_host_s_name_whole(tmp_path: Path, host: str, same_as: str) -> None:
    c = keyed(tmp_path, {"host": True})
    assert c.context(request(host=host)).keys == c.context(request(host=same_as)).keys


def test_ipv6_hosts_are_distinct_buckets(tmp_path: Path) -> None:
    c = keyed(tmp_path, {"host": True})
    hosts = [f"[::{i:x}]" for i in range(1, 11)] + ["[2001:db8::1]:443", "example.com"]
    assert len({c.context(request(host=h)).keys for h in hosts}) == len(hosts)


def test_a_rule_s_hosts_match_ipv6_literals_and_names_alike(tmp_path: Path) -> None:
    c = Classifier(policy_from(tmp_path, {"classification": {"rules": [
        {"match": {"hosts": ["[::1]", "Admin.Example.com"]}, "tier": "critical"}]}}))
    for host, tier in (("[::1]:9000", "critical"), ("[0::1]", "critical"), ("[::2]", "get"),
                       ("admin.example.COM.:443", "critical")):
        assert c.context(request(host=host)).tier.value == tier, host
