"""Inline policies in the chart's values are checked at ``helm install``/``template`` time:
values.schema.json carries the policy JSON Schema (generated from the pydantic models, the
one schema the server and ``extauthz schema`` use) under ``$defs.policy``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from extauthz.policy import load_policy
from extauthz.policy.jsonschema import CHART_DEF, chart_policy_schema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "extauthz"
GOOD = yaml.safe_load((ROOT / "policies" / "api.yaml").read_text())


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def values_schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return loaded


def render(chart: Any, policies: dict[str, Any]) -> dict[str, str]:
    manifests = chart.render({"policies": policies}, name="extauthz", namespace="extauthz", is_install=True)
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "ConfigMap" and "api.yaml" in doc.get("data", {}):
                data: dict[str, str] = doc["data"]
                return data
    raise AssertionError("no policy ConfigMap rendered")


def test_the_chart_schema_carries_the_current_policy_schema() -> None:
    assert values_schema()["$defs"][CHART_DEF] == chart_policy_schema(), (
        "run: python -m extauthz.policy.jsonschema helm/extauthz/values.schema.json")
    jsonschema.Draft7Validator.check_schema(values_schema())


def test_a_good_inline_policy_renders_and_the_server_loads_it(chart: Any, tmp_path: Path) -> None:
    data = render(chart, {"api.yaml": GOOD})
    (tmp_path / "api.yaml").write_text(data["api.yaml"])
    assert [s.name for s in load_policy([tmp_path]).limiters] == [s["name"] for s in GOOD["limiters"]]


@pytest.mark.parametrize(("change", "field"), [
    (lambda p: p["limiters"][0].update(burts=500), "burts"),           # a misspelt field
    (lambda p: p["limiters"][0].update(type="request_rat"), "request_rat"),  # an unknown limiter type
    (lambda p: p.update(version="one"), "version"),                   # a wrong type
])
def test_a_broken_inline_policy_fails_helm_install(chart: Any, change: Any, field: str) -> None:
    bad = copy.deepcopy(GOOD)
    change(bad)
    with pytest.raises(helm.HelmValuesError, match="policies"):
        chart.render({"policies": {"api.yaml": bad}}, name="extauthz", namespace="extauthz", is_install=True)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(values_schema()).validate({"policies": {"api.yaml": bad}} | {
            k: v for k, v in yaml.safe_load((CHART / "values.yaml").read_text()).items() if k != "policies"})
