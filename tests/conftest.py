"""Shared test helpers. Real-Redis fixtures live in tests/infra (loaded via addopts) over testinfra/."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.clock import ManualClock

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
