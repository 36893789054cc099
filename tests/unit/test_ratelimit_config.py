"""``extauthz import ratelimit-config``: envoyproxy/ratelimit's README examples converted,
and the converted policy deciding as the README says (each descriptor through the engine,
as ShouldRateLimit runs it); what cannot be converted refused with file and line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.commands.ratelimit_config import ConvertError, convert, convert_paths
from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.policy import load_policy
from extauthz.policy.classify import Classifier
from extauthz.policy.descriptors import entries_of
from testinfra.probes import resolve

from .helpers import engine_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ratelimit"
BAD = sorted((FIXTURES / "bad").glob("*.yaml"))


class Peer:
    """A converted policy answering ShouldRateLimit requests as the server's door does."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        assert main(["import", "ratelimit-config", str(FIXTURES / name), "-o", str(tmp_path)]) == 0
        self.policy = load_policy([tmp_path])
        self.clock = ManualClock(1_800_000_000.0)  # a Thursday, 00:00 UTC: every window starts
        self.engine, _ = engine_for(self.policy, self.clock)
        self.classifier = Classifier(self.policy, salt=b"s")

    async def ask(self, domain: str, *descriptors: dict[str, str]) -> str:
        """OK or OVER_LIMIT, as the response's overall_code."""
        targets = resolve(self.policy.descriptors, domain, [entries_of(d) for d in descriptors])
        over = False
        for d, target in zip(descriptors, targets, strict=True):
            if target is None or target.unlimited:
                continue
            raw = RawRequest("", "", descriptor=d, descriptor_target=target.name)
            over |= not (await self.engine.decide(self.classifier.context(raw))).allowed
        return "OVER_LIMIT" if over else "OK"

    async def passes(self, n: int, domain: str, *descriptors: dict[str, str]) -> int:
        """How many of n requests in a row are answered OK."""
        return sum([await self.ask(domain, *descriptors) == "OK" for _ in range(n)])


async def test_each_database_limited_on_its_own(tmp_path: Path) -> None:
    peer = Peer(tmp_path, "mongo_cps.yaml")
    assert await peer.passes(501, "mongo_cps", {"database": "users"}) == 500
    assert await peer.passes(501, "mongo_cps", {"database": "default"}) == 500
    assert await peer.passes(600, "mongo_cps", {"database": "other"}) == 600  # no limit
    peer.clock.advance(1.0)  # the next second
    assert await peer.ask("mongo_cps", {"database": "users"}) == "OK"


async def test_marketing_messages_per_number(tmp_path: Path) -> None:
    peer = Peer(tmp_path, "messaging.yaml")
    marketing = {"message_type": "marketing", "to_number": "2061111111"}
    number = {"to_number": "2061111111"}
    # Envoy sends both descriptors; the marketing one runs out after 5 a day
    assert await peer.passes(6, "messaging", marketing, number) == 5
    # other messages to that number: 100 a day, 6 used
    assert await peer.passes(100, "messaging", number) == 94
    assert await peer.passes(3, "messaging", {"to_number": "2062222222"}) == 3  # per number
    peer.clock.advance(86400.0)  # the next day
    assert await peer.ask("messaging", marketing, number) == "OK"


async def test_a_default_a_value_of_its_own_and_nested_paths(tmp_path: Path) -> None:
    peer = Peer(tmp_path, "edge_proxy_header.yaml")
    d = "edge_proxy_per_client"
    assert await peer.passes(11, d, {"client_id": "c1"}) == 10
    assert await peer.passes(101, d, {"client_id": "premium"}) == 100
    assert await peer.passes(6, d, {"client_id": "c2", "path": "/search"}) == 5
    # the premium node has no path under it: the walk never falls back to the default's
    assert await peer.passes(7, d, {"client_id": "premium", "path": "/search"}) == 7


async def test_replaces(tmp_path: Path) -> None:
    peer = Peer(tmp_path, "replaces.yaml")
    bar = {"source_cluster": "proxy", "destination_cluster": "bar"}
    user = {"source_cluster": "proxy", "user_id": "u1"}
    foo = {"source_cluster": "proxy", "foo": "f"}
    assert await peer.passes(2, "example5", bar) == 1  # bkthomps alone: 1 a minute
    assert await peer.passes(3, "example5", user) == 2  # fake_name alone: 2 a minute
    # with foo's descriptor in the request, bkthomps and fake_name are not applied: foo's 3 decide
    assert await peer.passes(4, "example5", bar, user, foo) == 3


async def test_shadow_unlimited_and_a_value_prefix(tmp_path: Path) -> None:
    peer = Peer(tmp_path, "shadow_unlimited_wildcard.yaml")
    d = "example6"
    assert await peer.passes(5, d, {"remote_address": "10.0.0.1"}) == 5  # shadow
    assert await peer.passes(50, d, {"ldap": "x"}) == 50  # unlimited
    assert await peer.passes(3, d, {"azure": "x"}) == 2
    assert await peer.passes(3, d, {"path": "/foo/bar"}) == 2
    assert await peer.passes(3, d, {"path": "/foo/baz"}) == 2  # per value
    assert await peer.passes(3, d, {"path": "/bar"}) == 3  # no limit


def test_the_converted_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", "ratelimit-config", str(FIXTURES), "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in FIXTURES.glob("*.yaml"))
    assert "unit day" not in capsys.readouterr().err  # no calendar-unit warning for days
    doc = yaml.safe_load((tmp_path / "replaces.yaml").read_text())
    by_name = {lim["name"]: lim for lim in doc["limiters"]}
    assert by_name["bkthomps"] == {"name": "bkthomps", "type": "quota", "limit": 1, "period": "minute", "match": {
        "domain": "example5", "descriptor": [{"key": "source_cluster", "value": "proxy"},
                                             {"key": "destination_cluster", "value": "bar"}]}}
    foo = by_name["example5.source_cluster_proxy.foo"]
    assert sorted(foo["replaces"]) == ["bkthomps", "fake_name"]
    shadow = yaml.safe_load((tmp_path / "shadow_unlimited_wildcard.yaml").read_text())
    assert shadow["limiters"][0]["mode"] == "shadow"
    assert shadow["unlimited"] == [{"name": "example6.ldap", "match": {"domain": "example6",
                                                                      "descriptor": [{"key": "ldap"}]}}]
    # printed without -o: every file, each checked
    assert main(["import", "ratelimit-config", str(FIXTURES / "mongo_cps.yaml")]) == 0
    assert yaml.safe_load(capsys.readouterr().out.split("---")[0])["limiters"][0]["limit"] == 500


def test_calendar_units_are_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "monthly.yaml"
    f.write_text("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: month, requests_per_unit: 5}\n")
    assert main(["import", "ratelimit-config", str(f)]) == 0
    assert "unit month: calendar months in UTC here" in capsys.readouterr().err


def test_a_domain_in_two_files_is_refused(tmp_path: Path) -> None:
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, "
                                     "requests_per_unit: 1}\n")
    with pytest.raises(ConvertError, match=r"b\.yaml:1: duplicate domain 'd' \(first in .*a\.yaml\)"):
        convert_paths([str(tmp_path)])


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_what_cannot_be_converted_is_refused_with_file_and_line(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    assert main(["import", "ratelimit-config", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path.parent}/{expected}"


def test_replaces_drops_every_limit_of_that_name(tmp_path: Path) -> None:
    # the peer's names need not be unique: its replaces drops every limit so named
    text = """\
domain: d
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1, name: shared}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 1, name: shared}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 9, replaces: [{name: shared}]}
"""
    (conv,) = convert([("d.yaml", text)])
    by_shape = {lim["match"]["descriptor"][0]["key"]: lim for lim in conv.limiters}
    assert sorted(by_shape["c"]["replaces"]) == sorted([by_shape["a"]["name"], by_shape["b"]["name"]])
    (tmp_path / "d.yaml").write_text(conv.text())
    found = resolve(load_policy([tmp_path]).descriptors, "d", [entries_of({"a": "1"}), entries_of({"b": "1"}),
                                                               entries_of({"c": "1"})])
    assert [t.name if t is not None else None for t in found] == [None, None, by_shape["c"]["name"]]


def test_value_to_metric_is_accepted_with_a_warning() -> None:
    text = "domain: d\ndescriptors:\n  - key: a\n    value_to_metric: true\n    rate_limit: {unit: second, " \
           "requests_per_unit: 1}\n"
    (conv,) = convert([("d.yaml", text)])
    assert len(conv.limiters) == 1
    assert conv.warnings == ["d.yaml:4: value_to_metric: metrics only, not converted (the decisions are the same)"]


def test_a_value_with_an_empty_descriptors_list_keeps_its_node(tmp_path: Path) -> None:
    # the peer finds a_x (no limit, no children) and applies no limit; it never falls back to a's
    text = """\
domain: d
descriptors:
  - key: a
    value: x
    descriptors: []
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1}
"""
    (conv,) = convert([("d.yaml", text)])
    (tmp_path / "d.yaml").write_text(conv.text())
    found = resolve(load_policy([tmp_path]).descriptors, "d", [entries_of({"a": "x"}), entries_of({"a": "y"})])
    assert [(t.name, t.unlimited) if t is not None else None for t in found] == [
        ("", True), (conv.limiters[0]["name"], False)]


def test_a_limit_past_the_largest_count_is_warned_about(tmp_path: Path) -> None:
    text = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: year, requests_per_unit: 4294967295}\n"
    (conv,) = convert([("d.yaml", text)])
    assert conv.limiters[0]["limit"] == 1_000_000_000
    assert "d.yaml:4: requests_per_unit 4294967295: at most 1000000000 here" in conv.warnings[0]
