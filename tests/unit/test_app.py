"""``extauthz/server/app.py``: how the server wires its operations (it builds the owners; their
behaviour: tests/integration)."""

from __future__ import annotations

import dataclasses
import inspect

from extauthz.core.settings import Settings
from extauthz.server.app import Server
from extauthz.server.opsports import OperatorPorts


def test_the_server_takes_the_one_settings_object_not_its_options() -> None:
    """Server reads its options from Settings; its other parameters are built things (the
    operations Server wires were built by Operations, which this test held to the same rule)."""
    params = inspect.signature(Server.__init__).parameters
    assert list(params)[:2] == ["self", "config"]
    restated = set(params) & {f.name for f in dataclasses.fields(Settings)}
    assert restated == set(), f"options restated as parameters: {sorted(restated)}"


def test_the_operator_ports_are_read_from_settings_in_one_place() -> None:
    ports = OperatorPorts.from_settings(Settings(listen="127.0.0.1:9101", admin_listen="127.0.0.1:9102",
                                                 metrics_listen="off"))
    assert (ports.admin_listen, ports.metrics_listen) == ("127.0.0.1:9102", None)
