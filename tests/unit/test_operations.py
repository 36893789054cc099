"""``extauthz/server/operations.py``: how Operations is built (its behaviour: tests/integration)."""

from __future__ import annotations

import dataclasses
import inspect

from extauthz.server.operations import Operations
from extauthz.settings import Settings


def test_operations_takes_the_one_settings_object_not_its_options() -> None:
    """Operations reads its options from Settings; its other parameters are built things."""
    params = inspect.signature(Operations.__init__).parameters
    assert list(params)[:2] == ["self", "settings"]
    restated = set(params) & {f.name for f in dataclasses.fields(Settings)}
    assert restated == set(), f"options restated as parameters: {sorted(restated)}"
