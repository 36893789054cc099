"""End-to-end fixtures: the quick start's stack (Envoy + server process + upstream)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

from ..conftest import ROOT


@pytest.fixture(scope="module")
def quickstart_stack() -> Iterator[Stack]:
    """The README quick start's stack: envoy/envoy.yaml and policies/, embedded store."""
    with Stack([ROOT / "policies"]) as stack:
        yield stack


@pytest.fixture
def client() -> Iterator[HttpClient]:
    with HttpClient() as c:
        yield c
