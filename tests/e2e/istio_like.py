"""envoy/istio-like.yaml (Envoy as istiod configures a gateway for extauthz) on loopback ports,
with the chart's Istio example policy, for tests/e2e/test_istio_e2e.py and test_rolling_e2e.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from extauthz.envoy.config import GRPC_ACCESS_LOGGER
from testinfra.envoy_configs import config_path, validate

from ..conftest import ROOT

CONFIG = config_path("istio-like.yaml")
ISTIO_EXAMPLES = ROOT / "helm" / "extauthz" / "examples" / "istio"
EXTAUTHZ_CLUSTER = "outbound|9001||extauthz.extauthz.svc.cluster.local"
API_CLUSTER = "outbound|8080||api.default.svc.cluster.local"
STAT_PREFIX = "http.outbound_0.0.0.0_8080."
#: Envoy's defaults for a gRPC access logger without buffer settings (as Istio generates it).
DEFAULT_FLUSH_INTERVAL = 1.0


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    [listener] = config["static_resources"]["listeners"]
    [chain] = listener["filter_chains"]
    [manager] = chain["filters"]
    typed: dict[str, Any] = manager["typed_config"]
    return typed


def envoyfilter_access_logger() -> dict[str, Any]:
    """The access logger that examples/istio/envoyfilter-als.yaml patches in (buffer 0)."""
    doc = yaml.safe_load((ISTIO_EXAMPLES / "envoyfilter-als.yaml").read_text())
    [patch] = doc["spec"]["configPatches"]
    [logger] = patch["patch"]["value"]["typed_config"]["access_log"]
    found: dict[str, Any] = copy.deepcopy(logger)
    return found


def render(extauthz: list[int], upstream: int, *, envoyfilter_als: bool = False,
           als_flush_interval: str | None = None) -> str:
    """The config with the extauthz cluster on ``extauthz`` ports (several: one endpoint each)
    and the API cluster on ``upstream``; ``envoyfilter_als`` swaps Istio's access logger for the
    EnvoyFilter alternative's, with its ``buffer_flush_interval`` set to ``als_flush_interval``
    when given. Validated with ``envoy --mode validate`` before it is returned."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    for cluster in config["static_resources"]["clusters"]:
        ports = {EXTAUTHZ_CLUSTER: extauthz, API_CLUSTER: [upstream]}[cluster["name"]]
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in ports]}]
    if envoyfilter_als:
        manager = hcm(config)
        manager["access_log"] = [a for a in manager["access_log"] if a["name"] != GRPC_ACCESS_LOGGER]
        logger = envoyfilter_access_logger()
        if als_flush_interval is not None:
            logger["typed_config"]["common_config"]["buffer_flush_interval"] = als_flush_interval
        manager["access_log"].append(logger)
    text = yaml.safe_dump(config, sort_keys=False)
    validate(text)
    return text


def istio_policy(directory: Path) -> Path:
    """The policy of examples/istio/values-istio.yaml (classification rules only) as a file."""
    values = yaml.safe_load((ISTIO_EXAMPLES / "values-istio.yaml").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "api.yaml").write_text(values["policies"]["api.yaml"])
    return directory
