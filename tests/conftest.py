"""Shared test helpers. Real-Redis fixtures live in tests/infra (loaded via addopts) over testinfra/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.devtools import stack

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker picks ports from its own hundreds (``gw1`` of 2: the
    odd ones), so two workers never hand out the same port between a check and a bind
    (devtools/stack.py reads the same variables on import, for the processes a worker starts)."""
    stack.PORT_STRIPE = stack.stripe_of(os.environ)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, the tests marked ``serial`` are left out: scripts/test runs
    them after, in one process (``-n 0 -m serial``)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    alone = [item for item in items if item.get_closest_marker("serial") is not None]
    if alone:
        config.hook.pytest_deselected(items=alone)
        items[:] = [item for item in items if item.get_closest_marker("serial") is None]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


#: what serves the gRPC port (``serve --grpc-server``): the default first. The whole suite
#: runs on the default; the tests of the gRPC door itself (tests/integration/test_server.py,
#: the parity test, the gRPC e2e files: check, TLS/mTLS, access-log release, health) take
#: :func:`grpc_server_kind` and so run on both, which keeps CI's time. Server processes
#: started by testinfra read ``EXTAUTHZ_GRPC_SERVER`` from the environment, so
#: ``EXTAUTHZ_GRPC_SERVER=grpcio pytest tests/e2e`` runs every e2e file on grpcio.
GRPC_SERVERS = ("asyncio", "grpcio")


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def grpc_server_kind(request: pytest.FixtureRequest) -> str:
    """``asyncio`` (server/grpc_h2.py, the default) or ``grpcio`` (grpc.aio); module scoped,
    so a module's servers start once per kind."""
    return str(request.param)
