"""What each protocol sends and each edge reads: the header lists, the ext_authz filter's
``allowed_headers``, and what Envoy's HTTP authorization protocol cannot carry.

The edges (``server/edge.py``, ``server/httpmap.py``) read these names; the config generator
(:mod:`extauthz.envoy.config`) writes the same names into the filters Envoy runs. One list
each, so that what Envoy sends and what the server reads cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..core.context import REQUEST_ID_HEADER
from ..engine.answers import PROTOCOLS

if TYPE_CHECKING:
    from ..policy.model import Policy

__all__ = ["ALWAYS_SENT", "CLIENT_HEADERS_ON_DENY", "CLIENT_HEADERS_ON_SUCCESS", "FAILURE_MODE_HEADER",
           "FORWARDED_FOR_HEADER", "GRPC_EDGE_HEADERS", "HTTP_EDGE_HEADERS", "JWT_NAMESPACE",
           "JWT_PAYLOAD_HEADER", "JWT_PAYLOAD_KEY", "ROUTE_KEY_PARTS", "ROUTE_TIER_HEADER", "SHED_STATUS",
           "TRACE_HEADERS", "XFCC_HEADER", "allowed_headers", "unreadable_over_http"]

#: the status that marks a load shedder's (or a fail-closed limiter's) refusal: Envoy does not
#: forward a 5xx from an authorization service (it counts an error and fails open or closed),
#: so the shipped configs map this status to 503 with ``local_reply_config``.
SHED_STATUS = 420
#: set by a per-route ``header_mutation`` filter from the route (client copies stripped
#: first); the HTTP protocol's stand-in for route metadata.
ROUTE_TIER_HEADER = "x-extauthz-route-tier"
#: where ``jwt_authn``'s ``forward_payload_header`` puts the verified payload (base64url JSON).
JWT_PAYLOAD_HEADER = "x-jwt-payload"
#: the namespace and key the forwarded payload is filed under for ``metadata`` identity rules,
#: as ``jwt_authn`` with ``payload_in_metadata: payload`` files it for the gRPC protocol (also
#: the ``jwt_authn`` filter's name, whose dynamic metadata the gRPC protocol forwards).
JWT_NAMESPACE = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD_KEY = "payload"
#: Envoy's client-certificate header (``forward_client_cert_details``); ``URI=`` is the principal.
XFCC_HEADER = "x-forwarded-client-cert"
#: the client address: the LAST entry, the one Envoy appends (``use_remote_address: true``).
FORWARDED_FOR_HEADER = "x-forwarded-for"
#: the request header Envoy's ext_authz filter adds when it let a request through on a failed
#: check (``failure_mode_allow_header_add: true``); the access log carries it back
#: (``extauthz envoy-config`` logs it: ``additional_request_headers_to_log``, fluentd ``%REQ``)
FAILURE_MODE_HEADER = "x-envoy-auth-failure-mode-allowed"

#: the W3C trace context the HTTP edge reads to parent its span (``server/http.py``)
TRACE_HEADERS = ("traceparent", "tracestate")
#: headers the HTTP edge reads whatever the policy says (``envoy-allowed-headers`` lists them).
HTTP_EDGE_HEADERS = (REQUEST_ID_HEADER, FORWARDED_FOR_HEADER, ROUTE_TIER_HEADER, JWT_PAYLOAD_HEADER,
                     XFCC_HEADER, *TRACE_HEADERS)
#: headers the gRPC edge reads whatever the policy says (the request id that pairs a Check
#: with its access-log entry; ``envoy-allowed-headers --protocol grpc`` lists them). The
#: trace parent arrives in the Check call's gRPC metadata, the client address, the route's
#: tier and the JWT payload in attributes.
GRPC_EDGE_HEADERS = (REQUEST_ID_HEADER,)
#: headers Envoy sends an HTTP authorization service whatever ``allowed_headers`` says.
ALWAYS_SENT = frozenset({"host", ":authority", "authorization", "content-length", ":method", ":path"})

#: the answer headers the HTTP protocol passes to the client, on an allowed and a refused check
#: (``extauthz k8s`` names the same in Istio's provider)
CLIENT_HEADERS_ON_SUCCESS = ("ratelimit-policy", "ratelimit")
CLIENT_HEADERS_ON_DENY = ("content-type", "retry-after", "ratelimit-policy", "ratelimit")


def allowed_headers(needed: Iterable[str], protocol: str = "http") -> list[str]:
    """What the ext_authz filter's ``allowed_headers`` must list for a policy that reads
    ``needed`` (``Policy.needed_headers``): those, then the ones the edge of ``protocol``
    reads (``extauthz envoy-allowed-headers``). The HTTP protocol leaves out the headers Envoy
    always sends an HTTP service; the gRPC protocol sends nothing it does not list (an unset
    list sends every header), so Authorization stays in its list."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    implied = ALWAYS_SENT if protocol == "http" else frozenset()
    edge = HTTP_EDGE_HEADERS if protocol == "http" else GRPC_EDGE_HEADERS
    out = [h for h in sorted({h.lower() for h in needed}) if h not in implied]
    return out + [h for h in edge if h not in out]


#: key parts read from the route (its metadata or context extensions): the HTTP protocol
#: carries neither, so behind it they yield nothing.
ROUTE_KEY_PARTS = frozenset({"route", "route_metadata", "context_extension"})


def unreadable_over_http(policy: Policy) -> list[str]:
    """What ``policy`` reads that Envoy's HTTP authorization protocol does not carry, one
    sentence each (``envoy-config --protocol http`` and ``serve --http-listen`` say them): a
    key part read from the route (its limiter then skips every request, or with
    ``on_missing_key: shared`` counts them all in one bucket), and filter metadata other than
    the JWT payload ``jwt_authn`` forwards."""
    problems = []
    for name, index in policy.key_index.items():
        for part in policy.keys[index].parts:
            if part.kind in ROUTE_KEY_PARTS:
                problems.append(
                    f"limiter '{name}': key part {part.label} yields nothing on the HTTP protocol "
                    "(no route metadata or context extensions there): use the gRPC protocol, or a "
                    "header the route sets")
    for namespace, paths in policy.needed_metadata.items():
        for path in paths:
            if namespace != JWT_NAMESPACE or not path or path[0] != JWT_PAYLOAD_KEY:
                problems.append(
                    f"metadata {namespace}:{'.'.join(path)} yields nothing on the HTTP protocol "
                    f"(it carries only the JWT payload, as {JWT_NAMESPACE}:{JWT_PAYLOAD_KEY}.<claim>)")
    return problems
