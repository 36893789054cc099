"""The project's shipped Envoy configs, found and checked (what only the tests need of them,
kept out of the package, issue 30).

``envoy/`` at the repository root is the one copy of the shipped configs: the wheel ships it as
the ``extauthz/envoy/configs/`` data directory (``package-dir`` in pyproject.toml), and a source
checkout reads it in place (:func:`config_path`). :func:`validate` runs ``envoy --mode
validate`` plus the cluster-reference check that Envoy itself does not make.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from extauthz.devtools.envoy_process import EnvoyError, find_envoy

__all__ = ["DEFAULT_CONFIG", "GRPC_CONFIGS", "HTTP_CONFIG", "EnvoyConfigError", "config_path",
           "grpc_cluster_problems", "load_config_text", "validate"]

DEFAULT_CONFIG = "envoy.yaml"
#: the same proxy on Envoy's HTTP authorization protocol (``extauthz demo --protocol http``).
HTTP_CONFIG = "envoy-http.yaml"
#: the shipped configs on the gRPC protocol (their ``allowed_headers`` come from
#: ``extauthz envoy-allowed-headers --protocol grpc``). ``istio-like.yaml`` is not one of
#: them: it is what istiod generates, and istiod sets no ``allowed_headers`` for a gRPC provider.
GRPC_CONFIGS = (DEFAULT_CONFIG, "envoy-tls.yaml", "envoy-jwt.yaml")


class EnvoyConfigError(EnvoyError):
    """A config failed ``envoy --mode validate`` or the cluster-reference check."""


# ---- locating files -------------------------------------------------------------------


def config_path(name: str = DEFAULT_CONFIG) -> Path:
    """The shipped config ``name`` (``envoy/<name>``): the wheel's copy, else the checkout's."""
    shipped = resources.files("extauthz").joinpath("envoy").joinpath("configs").joinpath(name)
    if shipped.is_file():  # installed from a wheel: extauthz/envoy/configs/ is package data
        return Path(str(shipped))
    # A source checkout (an editable install maps extauthz.envoy.configs to the top-level envoy/,
    # which importlib cannot resolve for a data-only directory): read envoy/ in place.
    root = Path(__file__).resolve().parents[1]
    candidate = root / "envoy" / name
    if candidate.is_file() and (root / "pyproject.toml").is_file():
        return candidate
    raise FileNotFoundError(f"no Envoy config {name!r} in the extauthz package or {root / 'envoy'}")


def load_config_text(base: Path | None = None) -> str:
    """The text of ``base``, or of the default config (see :func:`config_path`)."""
    return Path(base if base is not None else config_path()).read_text(encoding="utf-8")


# ---- validation -----------------------------------------------------------------------


def grpc_cluster_problems(config: str | Mapping[str, Any]) -> list[str]:
    """Every ``envoy_grpc.cluster_name`` that names no static cluster, with its dotted path.

    ``envoy --mode validate`` does not catch these (ext_authz, access log, tracer): Envoy only
    fails them at run time, so a typo silently turns into fail-open or lost log entries.
    """
    data = yaml.safe_load(config) if isinstance(config, str) else config
    clusters = {
        c.get("name") for c in data.get("static_resources", {}).get("clusters", [])
    }
    problems = []
    for path, node in _walk(data, ""):
        grpc = node.get("envoy_grpc")
        if isinstance(grpc, Mapping):
            name = grpc.get("cluster_name")
            if name not in clusters:
                problems.append(
                    f"{path}.envoy_grpc.cluster_name: {name!r} names no defined cluster "
                    f"(defined: {', '.join(sorted(str(c) for c in clusters))})"
                )
    return problems


def _walk(node: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if isinstance(node, Mapping):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def validate(
    config_text: str, *, envoy_binary: str | None = None, timeout: float = 30.0
) -> None:
    """Run ``envoy --mode validate`` and the cluster-reference check; raise on any problem."""
    binary = envoy_binary or find_envoy()
    with tempfile.TemporaryDirectory(prefix="extauthz-envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(config_text, encoding="utf-8")
        result = subprocess.run(
            [binary, "--mode", "validate", "-c", str(path), "--log-level", "error"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise EnvoyConfigError(
            f"envoy --mode validate failed (exit {result.returncode}):\n{output}"
        )
    problems = grpc_cluster_problems(config_text)
    if problems:
        raise EnvoyConfigError("undefined gRPC clusters:\n" + "\n".join(problems))
