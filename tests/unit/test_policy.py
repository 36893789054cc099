"""The policy validator: the issue's example is accepted; every bad fixture fails with
its exact message (file, dotted path, line)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from extauthz.core.errors import PolicyError
from extauthz.core.tiers import Tier
from extauthz.policy import load_policy, loader
from extauthz.policy.jsonschema import policy_json_schema
from extauthz.policy.schema import (
    ConcurrentRequestsSpec,
    FleetUsageSpec,
    RequestRateSpec,
    WorkerUtilizationSpec,
)

from ..conftest import FIXTURES, ROOT

BAD = FIXTURES / "policies" / "bad"


def _expectation(path: Path) -> tuple[Path, str]:
    """(file carrying the '# expect:' line, the expected message)."""
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    for f in files:
        first = f.read_text().splitlines()[0]
        if first.startswith("# expect: "):
            message = first[len("# expect: "):].replace("{dir}", str(path))
            return f, f"{f.parent}/{message}"
    raise AssertionError(f"{path} has no '# expect:' line")


BAD_CASES = sorted(p for p in BAD.iterdir() if p.suffix == ".yaml" or p.is_dir())


LOADERS = {"libyaml": getattr(yaml, "CSafeLoader", None), "python": yaml.SafeLoader}


@pytest.fixture(params=sorted(LOADERS))
def yaml_loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message is the same with libyaml (the server's parser) and without it."""
    cls = LOADERS[request.param]
    if cls is None:
        pytest.skip("PyYAML without libyaml")
    monkeypatch.setattr(loader, "FAST_LOADER", cls)


@pytest.mark.usefixtures("yaml_loader")
@pytest.mark.parametrize("case", BAD_CASES, ids=[p.stem for p in BAD_CASES])
def test_bad_policy_reports_file_path_and_line(case: Path) -> None:
    _, expected = _expectation(case)
    with pytest.raises(PolicyError) as err:
        load_policy([case])
    messages = [str(i) for i in err.value.issues]
    assert expected in messages, f"expected {expected!r}, got {messages!r}"


def test_every_failure_mode_has_a_fixture() -> None:
    names = {p.stem for p in BAD_CASES}
    assert {"unknown_key", "bad_duration", "wrong_type", "dup_names", "unknown_limiter_type",
            "missing_field", "dup_identity", "yaml_syntax"} <= names


def test_the_issue_example_is_accepted_as_written() -> None:
    policy = load_policy([ROOT / "policies"])
    rate, conc, fleet, workers = policy.limiters
    assert isinstance(rate, RequestRateSpec) and (rate.rate, rate.burst, rate.cost) == (100, 500, 1)
    assert isinstance(conc, ConcurrentRequestsSpec) and (conc.limit, conc.lease_ttl) == (20, 60.0)
    assert isinstance(fleet, FleetUsageSpec) and (fleet.capacity, fleet.reserved_for_critical) == (1000, 0.2)
    assert isinstance(workers, WorkerUtilizationSpec)
    assert (workers.delay_before_shedding, workers.time_to_shed_all) == (28.0, 120.0)
    assert workers.signal.capacity == 200 and workers.sample_interval == 8.0
    assert [s.label for s in policy.identity] == ["header:x-api-key", "header:authorization", "source_ip"]
    assert policy.test_key_prefix == "sk_test_" and policy.test_header == "x-test-mode"
    assert policy.rules[0].tier is Tier.CRITICAL
    assert policy.needed_headers == {"x-api-key", "authorization", "x-test-mode"}


def test_directory_files_are_merged(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: 1\nidentity: [{header: x-api-key}]\n")
    (tmp_path / "b.yml").write_text(
        "version: 1\nlimiters:\n  - {name: r, type: request_rate, rate: '60/m', burst: 5}\n")
    (tmp_path / ".hidden.yaml").write_text("not: [valid")  # ConfigMap internals are skipped
    (tmp_path / "notes.txt").write_text("ignored")
    policy = load_policy([tmp_path])
    assert [s.name for s in policy.limiters] == ["r"]
    assert policy.limiters[0].rate == pytest.approx(1.0)  # type: ignore[union-attr]
    assert policy.identity[0].header == "x-api-key"


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("version: 1\nlimiters:\n  - {name: a, type: request_rate, rate: 0, burst: 5}\n"
                 "  - {name: b, type: concurrent_requests, limit: 0, colour: red}\n")
    with pytest.raises(PolicyError) as err:
        load_policy([f])
    got = {(i.path, i.line) for i in err.value.issues}
    assert got == {("limiters[0].rate", 3), ("limiters[1].limit", 4), ("limiters[1].colour", 4)}


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no such file or directory"):
        load_policy([tmp_path / "nope"])


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("60s", 60), ("2m", 120), ("1h", 3600), (7, 7)])
def test_durations(tmp_path: Path, text: object, seconds: float) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"version": 1, "limiters": [
        {"name": "c", "type": "concurrent_requests", "limit": 1, "lease_ttl": text}]}))
    if seconds < 1:
        with pytest.raises(PolicyError, match="greater than or equal to 1"):
            load_policy([f])
    else:
        assert load_policy([f]).limiters[0].lease_ttl == seconds  # type: ignore[union-attr]


def test_published_json_schema_is_current_and_accepts_the_example() -> None:
    committed = json.loads((ROOT / "docs" / "policy.schema.json").read_text())
    assert committed == policy_json_schema(), "regenerate: extauthz schema > docs/policy.schema.json"
    example = yaml.safe_load((ROOT / "policies" / "api.yaml").read_text())
    jsonschema.validate(example, committed)
    bad = dict(example, limiters=[{"name": "x", "type": "request_rate", "rate": 1, "burst": 1, "oops": 1}])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, committed)


def test_an_oversized_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    (tmp_path / "small.yaml").write_text("version: 1\n")
    big = tmp_path / "big.yaml"
    big.write_text("version: 1\nlimiters: [\n" + "#" * 200 + "\n")  # broken too: never parsed
    with pytest.raises(PolicyError) as err:
        load_policy([tmp_path], max_bytes=100)
    assert [str(i) for i in err.value.issues] == [
        f"{big}: the file is larger than 100 bytes (--policy-max-bytes); not parsed"]
    load_policy([tmp_path / "small.yaml"], max_bytes=11)  # exactly at the bound: accepted


def test_the_fast_yaml_parser_is_used_where_present() -> None:
    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML without libyaml")
    assert loader.FAST_LOADER is yaml.CSafeLoader
