"""Render the project's Envoy config locally, for the demo, tests and benchmarks.

:func:`local_render` is the one generator (:mod:`extauthz.envoy.config`) with every port on
loopback. Finding the shipped configs (``envoy/``) and ``envoy --mode validate`` are the
tests' (``testinfra/envoy_configs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from ..envoy.blocks import Config
from ..envoy.config import bootstrap
from ..policy.model import Policy

__all__ = ["local_render"]


def local_render(policy: Policy, *, protocol: str, grpc_port: int, upstream_port: int, http_port: int | None = None,
                 edit: Callable[[Config], None] | None = None, **options: Any) -> str:
    """The generator's config (:func:`extauthz.envoy.config.bootstrap`) for ``policy`` with
    everything on loopback: the listener and admin on port 0 (:class:`EnvoyProcess` finds
    them), the server's gRPC port ``grpc_port`` (on HTTP: its ``http_port`` for the check and
    ``grpc_port`` for the access log) and the upstream's port. ``options`` are the generator's
    (:class:`~extauthz.envoy.config.Options`: the variants tests and benchmarks run); ``edit``
    changes the mapping last, for a test that runs a config the generator would never write
    (a health check, a setting as it was before a fix)."""
    if protocol == "http" and http_port is None:
        raise ValueError("the HTTP protocol needs the server's http_port")
    loopback: dict[str, Any] = {
        "protocol": protocol, "upstream": ("127.0.0.1", upstream_port),
        "authz": ("127.0.0.1", http_port if protocol == "http" else grpc_port),
        "access_log_to": ("127.0.0.1", grpc_port) if protocol == "http" else None,
        "listen_port": 0, "admin_port": 0}
    config = bootstrap(policy, **(loopback | options))
    if edit is not None:
        edit(config)
    return yaml.safe_dump(config, sort_keys=False)
