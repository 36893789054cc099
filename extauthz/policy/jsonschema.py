"""The policy JSON Schema, generated from the pydantic models (for editors and CI)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .schema import PolicyFile


def policy_json_schema() -> dict[str, Any]:
    schema = PolicyFile.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "extauthz policy file"
    return schema


#: where the Helm chart's values.schema.json holds the policy schema (its ``$defs``)
CHART_DEF = "policy"


def chart_policy_schema() -> dict[str, Any]:
    """The policy schema as the chart's ``values.schema.json`` carries it under
    ``$defs.policy`` (draft-07 there): its references point into that place, so ``helm
    install``/``template`` refuse an inline policy (a mapping under ``policies``) that the
    server would refuse."""
    schema = policy_json_schema()
    del schema["$schema"]
    text = json.dumps(schema).replace('"#/$defs/', f'"#/$defs/{CHART_DEF}/$defs/')
    embedded: dict[str, Any] = _one_error(json.loads(text))
    return embedded


def _one_error(node: Any) -> Any:
    """The schema with its alternatives written so that a validator reports the one that
    applies, not every alternative (Helm printed ~20 lines for one bad number, where
    ``check-policies`` prints one): a ``oneOf`` with a ``discriminator`` (the limiter kinds)
    becomes ``if type is T then T's schema`` per kind, and ``anyOf [X, null]`` (an optional
    field) becomes ``if null (valid) else X``. The same documents validate."""
    if isinstance(node, list):
        return [_one_error(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _one_error(v) for k, v in node.items()}
    disc = node.get("discriminator")
    if disc is not None and "oneOf" in node:
        prop, mapping = disc["propertyName"], disc["mapping"]
        node.pop("discriminator")
        node.pop("oneOf")
        node.update({"type": "object", "required": [prop], "properties": {prop: {"enum": sorted(mapping)}},
                     "allOf": [{"if": {"properties": {prop: {"const": kind}}, "required": [prop]},
                                "then": {"$ref": ref}} for kind, ref in sorted(mapping.items())]})
    alternatives = node.get("anyOf")
    if isinstance(alternatives, list) and len(alternatives) == 2 and {"type": "null"} in alternatives:
        node.pop("anyOf")
        [other] = [a for a in alternatives if a != {"type": "null"}]
        node.update({"if": {"type": "null"}, "else": other})
    return node


def sync_chart_schema(path: str | Path) -> bool:
    """Write :func:`chart_policy_schema` into the chart's values.schema.json; True when it changed."""
    path = Path(path)
    values = json.loads(path.read_text())
    if values.get("$defs", {}).get(CHART_DEF) == chart_policy_schema():
        return False
    values.setdefault("$defs", {})[CHART_DEF] = chart_policy_schema()
    path.write_text(json.dumps(values, indent=2) + "\n")
    return True


if __name__ == "__main__":  # python -m extauthz.policy.jsonschema helm/extauthz/values.schema.json
    import sys

    for name in sys.argv[1:]:
        print(f"{name}: {'updated' if sync_chart_schema(name) else 'in sync'}")
