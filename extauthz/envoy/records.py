"""The access-log and fluentd record shapes: what fields Envoy is configured to send per
finished request, and where the server finds them.

The generator (:mod:`extauthz.envoy.config`) configures Envoy's loggers with these; the
receivers (``server/services.py``'s access-log stream, ``server/fluentd.py``) read them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .headers import FAILURE_MODE_HEADER

if TYPE_CHECKING:
    from ..policy.model import Policy

__all__ = ["EXT_AUTHZ_NAMESPACE", "FLUENTD_RECORD", "FLUENTD_TAG", "IN_FLIGHT_TYPES", "LEASE_NAMESPACES",
           "NEVER_LOGGED", "RATELIMIT_NAMESPACE", "ROUTE_TIER_TAG", "UNAUTHORIZED_FLAG", "route_tier_tag",
           "secret_headers", "unchecked_headers"]

#: where Envoy files the CheckResponse's dynamic metadata (and the access log shows it).
EXT_AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
#: where Envoy files the RateLimitResponse's dynamic metadata (the ratelimit filter's leases)
RATELIMIT_NAMESPACE = "envoy.filters.http.ratelimit"
#: the namespaces an access-log entry's lease fields are read from, in order
LEASE_NAMESPACES = (EXT_AUTHZ_NAMESPACE, RATELIMIT_NAMESPACE)
#: the gRPC access log's custom tag that carries the route's tier (route metadata where the
#: policy reads it: ``custom_tags`` of ``extauthz envoy-config``'s access log)
ROUTE_TIER_TAG = "extauthz.route_tier"

#: the tag ``extauthz envoy-config`` gives Envoy's fluentd logger (any tag is accepted)
FLUENTD_TAG = "extauthz.release"
#: the record Envoy's fluentd logger sends per finished request (its ``record`` setting)
FLUENTD_RECORD: dict[str, str] = {
    "request_id": "%REQ(X-REQUEST-ID)%",
    "ext_authz": f"%DYNAMIC_METADATA({EXT_AUTHZ_NAMESPACE})%",
    "response_flags": "%RESPONSE_FLAGS%",
    "start_us": "%START_TIME(%s%6f)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "original_path": "%REQ(X-ENVOY-ORIGINAL-PATH)%",
    "duration_ms": "%DURATION%",
    # a request Envoy let through unchecked: its fail-open header, and where it went (the tier)
    "failure_mode_allowed": f"%REQ({FAILURE_MODE_HEADER.upper()})%",
    "authority": "%REQ(:AUTHORITY)%",
    # DownstreamEnd; DownstreamStart / DownstreamPeriodic: an entry of a request still in flight
    "log_type": "%ACCESS_LOG_TYPE%",
}
#: the ``log_type`` of entries written while the request is still in flight
#: (``flush_access_log_on_new_request``, ``access_log_flush_interval``)
IN_FLIGHT_TYPES = frozenset({"DownstreamStart", "DownstreamPeriodic"})
#: the response flag Envoy sets on a request the ext_authz filter refused
UNAUTHORIZED_FLAG = "UAEX"

#: request headers the access log never carries, whatever the policy reads: credentials
NEVER_LOGGED = frozenset({"authorization", "proxy-authorization", "cookie"})


def secret_headers(policy: Policy) -> frozenset[str]:
    """The request headers that may carry a credential: the policy's identity, plan and key
    part headers, and :data:`NEVER_LOGGED`."""
    sources = (*policy.identity, *policy.plan_sources,
               *(part.source for key in policy.keys for part in key.parts if part.source is not None))
    return NEVER_LOGGED | {s.header.lower() for s in sources if s.header}


def unchecked_headers(policy: Policy) -> list[str]:
    """The request headers the access log carries back so that the server can count a request
    Envoy let through unchecked (docs/limiters.md "Unchecked requests"): Envoy's fail-open
    header, then the headers the policy's tier rules and test header read, less every header
    that may carry a credential (:func:`secret_headers`: no API key goes to the log; a tier
    rule on such a header then never matches an unchecked request's entry)."""
    names = {h.lower() for rule in policy.rules for h in rule.matcher.header_names}
    if policy.test_header:
        names.add(policy.test_header.lower())
    return [FAILURE_MODE_HEADER, *sorted(names - secret_headers(policy) - {FAILURE_MODE_HEADER})]


def route_tier_tag(policy: Policy) -> dict[str, Any] | None:
    """The access log's custom tag that carries the route's tier, from route metadata where
    the policy reads it (None: the policy reads it at a list index, which a tag cannot name)."""
    namespace, path = policy.route_metadata
    if not all(isinstance(step, str) for step in path):
        return None
    return {"tag": ROUTE_TIER_TAG, "metadata": {"kind": {"route": {}}, "metadata_key": {
        "key": namespace, "path": [{"key": step} for step in path]}}}
