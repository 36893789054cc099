"""The policy JSON Schema, generated from the pydantic models (for editors and CI)."""

from __future__ import annotations

from typing import Any

from .schema import PolicyFile

SCHEMA_ID = "https://extauthz.invalid/policy.schema.json"


def policy_json_schema() -> dict[str, Any]:
    schema = PolicyFile.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "extauthz policy file"
    return schema
