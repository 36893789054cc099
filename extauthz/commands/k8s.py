"""``extauthz k8s``: the Kubernetes resources that wire the server into a control plane.

* ``envoy-gateway``: a ``SecurityPolicy`` (``extAuth.grpc`` or ``.http``) with the headers the
  policy reads in ``headersToExtAuth`` and ``includeRouteMetadata`` when the policy reads Envoy
  Gateway's route metadata; the ``EnvoyProxy`` whose access log releases leases (only when the
  policy holds leases); the ``ReferenceGrant`` that lets both name a Service in another namespace.
* ``istio-sidecar`` (a sidecar or an ingress gateway, chosen by ``selector``) and
  ``istio-ambient`` (a waypoint, by ``targetRefs``): the mesh config's ``extensionProviders``
  entries (``envoyExtAuthzGrpc`` or ``envoyExtAuthzHttp``, and ``envoyHttpAls`` for the access
  log), an ``AuthorizationPolicy`` with ``action: CUSTOM``, and the ``Telemetry`` that turns the
  access log on.

The header lists are :func:`envoy.headers.allowed_headers` (``extauthz envoy-allowed-headers``)
less what the control plane cannot make trustworthy; the timeouts are
:func:`envoy.blocks.authz_timeout`; the answer headers are the ones ``envoy-config`` lets
through. The files in ``helm/extauthz/examples/`` (envoy-gateway/, istio/, istio-sidecar/,
istio-ambient/) are this output for the command line their test names
(tests/unit/test_k8s.py); tests/e2e/test_envoy_gateway_e2e.py, test_istio_e2e.py and
test_istio_ambient_e2e.py run the Envoy each implies. Field names: Envoy Gateway
``api/v1alpha1/securitypolicy_types.go``, ``ext_auth_types.go``; istio/api
``mesh/v1alpha1/config.proto`` (``MeshConfig.ExtensionProvider``). docs/gateways.md.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from ..core.settings import CHECK_BUDGET_MS, K8S_TARGETS
from ..engine.answers import TIER_HEADER
from ..envoy.blocks import authz_timeout
from ..envoy.config import DEFAULT_AUTHZ, holds_leases
from ..envoy.headers import (
    CLIENT_HEADERS_ON_DENY,
    CLIENT_HEADERS_ON_SUCCESS,
    JWT_PAYLOAD_HEADER,
    ROUTE_TIER_HEADER,
    allowed_headers,
)
from ..policy.model import Policy

__all__ = ["TARGETS", "Wiring", "headers_to_check", "reads_gateway_route_metadata", "render", "resources"]

Doc = dict[str, Any]

TARGETS = K8S_TARGETS
#: where Envoy Gateway files an HTTPRoute's ``gateway.envoyproxy.io/`` annotations (route metadata)
EG_NAMESPACE = "envoy-gateway"
#: the mesh-config provider names the AuthorizationPolicy and Telemetry refer to
PROVIDER = "extauthz"
ALS_PROVIDER = "extauthz-als"
#: the access log's log name (the server reads any; the shipped configs say this one)
LOG_NAME = "extauthz"
#: the status a request gets when the server cannot answer and the proxy fails closed
#: (``--fail-closed``): 503, retryable, as the server's own overload answer (Envoy's default
#: is 403, which reads as "not allowed")
STATUS_ON_ERROR = 503
GATEWAY_API = "gateway.networking.k8s.io"
EG_API = "gateway.envoyproxy.io/v1alpha1"


@dataclass(frozen=True)
class Wiring:
    """What the resources say besides the policy (``extauthz k8s`` options)."""

    target: str
    protocol: str = "grpc"
    #: the chart's Service and its namespace
    service: str = "extauthz"
    service_namespace: str = "extauthz"
    #: the Check port (gRPC) or HTTP authorization port; None: 9001 / 9003
    port: int | None = None
    #: the gRPC port that receives the access log
    als_port: int = DEFAULT_AUTHZ["grpc"][1]
    #: where the SecurityPolicy / AuthorizationPolicy / Telemetry go
    namespace: str = "default"
    #: the SecurityPolicy's or AuthorizationPolicy's name; None: ``extauthz-<protocol>`` on
    #: Envoy Gateway, ``extauthz`` on Istio
    name: str | None = None
    #: ``(kind, name)``: HTTPRoute or Gateway (Envoy Gateway); Gateway (the waypoint) or Service
    #: (ambient); on a sidecar, instead of ``selector``
    target_refs: tuple[tuple[str, str], ...] = ()
    #: workload labels (istio-sidecar: the pods, or ``istio=ingressgateway`` for the gateway)
    selector: tuple[tuple[str, str], ...] = ()
    #: Envoy Gateway ``contextExtensions`` (gRPC only): a ``tier``, limiter key parts
    context_extensions: tuple[tuple[str, str], ...] = ()
    #: Envoy Gateway ``extAuth.http.path``, Istio ``envoyExtAuthzHttp.pathPrefix`` (= the
    #: server's ``--http-path-prefix``; HTTP protocol only)
    http_path: str | None = None
    check_budget_ms: float = CHECK_BUDGET_MS
    #: Istio: paths the AuthorizationPolicy exempts from the Check call (``notPaths``), for
    #: every workload it covers; none by default (``--skip-path``)
    skip_paths: tuple[str, ...] = ()
    #: refuse requests (503) when the server cannot answer, instead of letting them through
    fail_closed: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"--target: one of {', '.join(TARGETS)}, not {self.target!r}")
        if self.protocol not in DEFAULT_AUTHZ:
            raise ValueError(f"--protocol: grpc or http, not {self.protocol!r}")
        for flag, port in (("--port", self.port), ("--als-port", self.als_port)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{flag}: 1-65535, not {port}")
        if self.http_path is not None and (self.protocol != "http" or not self.http_path.startswith("/")):
            raise ValueError("--http-path: a path starting with / (HTTP protocol only)")
        bad = [p for p in self.skip_paths if not p.startswith("/")]
        if bad:
            raise ValueError(f"--skip-path: a path starting with /, not {bad[0]!r}")
        if self.target == "envoy-gateway":
            if not self.target_refs:
                raise ValueError("--target-ref: envoy-gateway needs the HTTPRoute(s) or Gateway to protect")
            if self.selector:
                raise ValueError("--selector: Istio only (a SecurityPolicy is attached by --target-ref)")
            if self.context_extensions and self.protocol == "http":
                raise ValueError("--context-extension: gRPC only (the HTTP protocol carries none)")
            if self.skip_paths:
                raise ValueError("--skip-path: Istio only (a SecurityPolicy applies to the routes it targets: "
                                 "leave health-check routes out of --target-ref)")
        else:
            if self.context_extensions:
                raise ValueError("--context-extension: envoy-gateway only (Istio sets none)")
            if self.target == "istio-ambient" and self.selector:
                raise ValueError("--selector: a selector binds the policy to ztunnel, which cannot enforce CUSTOM: "
                                 "use --target-ref Gateway/<waypoint> (or Service/<name>)")
            if self.target == "istio-sidecar" and bool(self.selector) == bool(self.target_refs):
                raise ValueError("istio-sidecar: --selector KEY=VALUE (the workloads) or --target-ref, one of them")

    @property
    def authz_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_AUTHZ[self.protocol][1]

    @property
    def host(self) -> str:
        return f"{self.service}.{self.service_namespace}.svc.cluster.local"

    @property
    def refs(self) -> tuple[tuple[str, str], ...]:
        if self.target == "istio-ambient" and not self.target_refs:
            return (("Gateway", "waypoint"),)
        return self.target_refs


def reads_gateway_route_metadata(policy: Policy) -> bool:
    """Whether the policy reads Envoy Gateway's route metadata (a tier or a key part from an
    HTTPRoute's annotations): then the SecurityPolicy sets ``includeRouteMetadata``."""
    return any(namespace == EG_NAMESPACE for namespace, _ in policy.needed_route_metadata)


def headers_to_check(policy: Policy, wiring: Wiring) -> list[str]:
    """The request headers the proxy sends the server: ``envoy-allowed-headers``' list less the
    ones only ``envoy-config``'s own filters make trustworthy. No control plane here sets the
    route tier header (so the server is never sent one, and a client's copy cannot pick a tier);
    Envoy Gateway has no ``forward_payload_header`` for a verified JWT (nor a filter removing a
    client's ``x-jwt-payload``), so it never sends that header either."""
    dropped = {ROUTE_TIER_HEADER}
    if wiring.target == "envoy-gateway":
        dropped.add(JWT_PAYLOAD_HEADER)
    return [h for h in allowed_headers(policy.needed_headers, wiring.protocol) if h not in dropped]


def _ref(kind: str, name: str) -> Doc:
    return {"group": "" if kind == "Service" else GATEWAY_API, "kind": kind, "name": name}


def _backend(wiring: Wiring, port: int) -> Doc:
    return {"name": wiring.service, "namespace": wiring.service_namespace, "port": port}


def _security_policy(policy: Policy, wiring: Wiring) -> Doc:
    ms = f"{round(float(authz_timeout(wiring.check_budget_ms).removesuffix('s')) * 1000)}ms"
    ext: Doc
    if wiring.protocol == "grpc":
        ext = {"grpc": {"backendRefs": [_backend(wiring, wiring.authz_port)]},
               "headersToExtAuth": headers_to_check(policy, wiring)}
        if reads_gateway_route_metadata(policy):
            ext["includeRouteMetadata"] = True
        if wiring.context_extensions:
            ext["contextExtensions"] = [{"name": n, "type": "Value", "value": v} for n, v in wiring.context_extensions]
    else:
        http: Doc = {"backendRefs": [_backend(wiring, wiring.authz_port)]}
        if wiring.http_path is not None:
            http["path"] = wiring.http_path
        http["headersToBackend"] = [TIER_HEADER]
        ext = {"http": http, "headersToExtAuth": headers_to_check(policy, wiring)}
    ext |= {"failOpen": not wiring.fail_closed, "timeout": ms}
    if wiring.fail_closed:  # unused when failing open; the field needs Envoy Gateway v1.8.0 or later
        ext["statusOnError"] = STATUS_ON_ERROR
    return {"apiVersion": EG_API, "kind": "SecurityPolicy",
            "metadata": {"name": wiring.name or f"extauthz-{wiring.protocol}", "namespace": wiring.namespace},
            "spec": {"targetRefs": [_ref(k, n) for k, n in wiring.refs], "extAuth": ext}}


def _envoy_proxy(wiring: Wiring) -> Doc:
    return {"apiVersion": EG_API, "kind": "EnvoyProxy",
            "metadata": {"name": ALS_PROVIDER, "namespace": wiring.namespace},
            "spec": {"telemetry": {"accessLog": {"settings": [{"sinks": [{"type": "ALS", "als": {
                "type": "HTTP", "logName": LOG_NAME, "backendRefs": [_backend(wiring, wiring.als_port)]}}]}]}}}}


def _reference_grant(wiring: Wiring, kinds: Sequence[str]) -> Doc:
    return {"apiVersion": f"{GATEWAY_API}/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": "extauthz-from-envoy-gateway", "namespace": wiring.service_namespace},
            "spec": {"from": [{"group": "gateway.envoyproxy.io", "kind": k, "namespace": wiring.namespace}
                              for k in kinds],
                     "to": [{"group": "", "kind": "Service", "name": wiring.service}]}}


def _providers(policy: Policy, wiring: Wiring) -> Doc:
    timeout = authz_timeout(wiring.check_budget_ms)
    # both providers: failOpen, and statusOnError (a string) for when it fails closed
    failing = {"failOpen": not wiring.fail_closed, "statusOnError": str(STATUS_ON_ERROR)}
    provider: Doc
    if wiring.protocol == "grpc":
        # the gRPC provider has no header options: istiod sends every header
        provider = {"envoyExtAuthzGrpc": {"service": wiring.host, "port": wiring.authz_port, "timeout": timeout,
                                          **failing}}
    else:
        path = {"pathPrefix": wiring.http_path} if wiring.http_path is not None else {}
        provider = {"envoyExtAuthzHttp": {
            "service": wiring.host, "port": wiring.authz_port, "timeout": timeout, **path, **failing,
            "includeRequestHeadersInCheck": headers_to_check(policy, wiring),
            "headersToUpstreamOnAllow": [TIER_HEADER],
            "headersToDownstreamOnAllow": list(CLIENT_HEADERS_ON_SUCCESS),
            "headersToDownstreamOnDeny": list(CLIENT_HEADERS_ON_DENY)}}
    providers = [{"name": PROVIDER, **provider}]
    if holds_leases(policy):
        providers.append({"name": ALS_PROVIDER, "envoyHttpAls": {
            "service": wiring.host, "port": wiring.als_port, "logName": LOG_NAME}})
    return {"meshConfig": {"extensionProviders": providers}}


def _attachment(wiring: Wiring) -> Doc:
    if wiring.selector:
        return {"selector": {"matchLabels": dict(wiring.selector)}}
    return {"targetRefs": [_ref(k, n) for k, n in wiring.refs]}


def _authorization_policy(wiring: Wiring) -> Doc:
    name = wiring.name or (f"{PROVIDER}-waypoint" if wiring.target == "istio-ambient" else PROVIDER)
    # one empty rule matches every request (no rules would match none: nothing checked);
    # notPaths exempt those paths on every workload the policy covers, so only on request
    rule: Doc = {"to": [{"operation": {"notPaths": list(wiring.skip_paths)}}]} if wiring.skip_paths else {}
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": wiring.namespace},
            "spec": {**_attachment(wiring), "action": "CUSTOM", "provider": {"name": PROVIDER},
                     "rules": [rule]}}


def _telemetry(wiring: Wiring) -> Doc:
    # a narrower Telemetry replaces inherited access-log providers: a sidecar or gateway keeps
    # Envoy's stdout log (`envoy`) too; a waypoint has none to keep
    providers = [{"name": ALS_PROVIDER}] + ([{"name": "envoy"}] if wiring.target == "istio-sidecar" else [])
    return {"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry",
            "metadata": {"name": "extauthz-release", "namespace": wiring.namespace},
            "spec": {**_attachment(wiring), "accessLogging": [{"providers": providers}]}}


def resources(policy: Policy, wiring: Wiring) -> list[tuple[str, Doc]]:
    """``(comment, document)`` for each resource, in apply order."""
    out: list[tuple[str, Doc]] = []
    leases = holds_leases(policy)
    if wiring.target == "envoy-gateway":
        what = ("the Check call (gRPC port)" if wiring.protocol == "grpc" else
                "Envoy's HTTP authorization protocol (serve --http-listen; --http-path-prefix = extAuth.http.path); "
                "a shed request's 420 becomes 503 only with an EnvoyPatchPolicy (docs/gateways.md)")
        out.append((f"{what}; headersToExtAuth: the headers the policy reads "
                    f"(extauthz envoy-allowed-headers --protocol {wiring.protocol})",
                    _security_policy(policy, wiring)))
        kinds = ["SecurityPolicy"]
        if leases:
            kinds.append("EnvoyProxy")
            out.append(("the access log that releases leases (the policy holds some): name it in the Gateway's "
                        "spec.infrastructure.parametersRef", _envoy_proxy(wiring)))
        if wiring.service_namespace != wiring.namespace:
            out.append((f"lets the resources in {wiring.namespace} name the Service in {wiring.service_namespace}",
                        _reference_grant(wiring, kinds)))
        return out
    where = "the waypoint" if wiring.target == "istio-ambient" else "the selected workloads"
    out.append(("merge into the mesh config (istiod's meshConfig value, or the istio ConfigMap's mesh key)"
                + ("; the HTTP provider also needs an EnvoyFilter: docs/helm.md" if wiring.protocol == "http" else ""),
                _providers(policy, wiring)))
    skipped = f"every path but {', '.join(wiring.skip_paths)} (--skip-path)" if wiring.skip_paths else "every path"
    out.append((f"the Check call on {where}, {skipped}", _authorization_policy(wiring)))
    if leases:
        out.append((f"the access log that releases leases, on {where}", _telemetry(wiring)))
    return out


def render(policy: Policy, wiring: Wiring) -> str:
    """The resources as one multi-document YAML text, each with its comment."""
    return "---\n".join(
        "".join(f"# {line}\n" for line in textwrap.wrap(comment, 96))
        + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
        for comment, doc in resources(policy, wiring))
