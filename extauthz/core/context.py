"""The request as the engine sees it, converted once at the edge.

:class:`RawRequest` is what the server layer extracts from Envoy's CheckRequest (plain
strings and dicts, no protobuf). :func:`extauthz.policy.classify.Classifier.context` turns it
into a :class:`RequestContext`: identity (hashed), test mode and tier. Nothing below the
edge walks protobuf attribute chains.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .tiers import Tier
from .verdict import Limits

_N = TypeVar("_N", int, float)

_EMPTY: Mapping[str, str] = {}
#: the request id Envoy sets (or keeps): it pairs a check with the request's access-log entry
REQUEST_ID_HEADER = "x-request-id"
_NO_OVERRIDES: Mapping[str, Mapping[str, Limits]] = {}


def host_name(host: str) -> str:
    """A Host header's name as the policy compares and counts it: without the port, lower
    case (DNS names are case-insensitive), without a trailing dot; an IPv6 literal whole and
    in its one text form (``[::1]:8080``, ``[0:0::1]`` and a bare ``::1`` are ``[::1]``).
    Text that is none of these (``[::1`` without its ``]``) is only trimmed and lowered."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host
        literal, rest = host[1:end], host[end + 1:]
        if rest and not (rest[0] == ":" and rest[1:].isdigit()):
            return host  # "[v6]junk": not a host and port
        return _v6(literal) or host[: end + 1]
    if host.count(":") > 1:  # a bare IPv6 address (not a valid Host, but seen)
        return _v6(host) or host
    name = host.split(":", 1)[0]
    return name[:-1] if name.endswith(".") else name


def _v6(text: str) -> str:
    """``text`` as a bracketed IPv6 literal in its compressed form, or "" if it is not one."""
    try:
        return f"[{ipaddress.IPv6Address(text).compressed}]"
    except ValueError:
        return ""


@dataclass(frozen=True, slots=True)
class RawRequest:
    method: str
    path: str
    host: str = ""
    #: raw header values (API keys, Authorization): kept out of repr, so that a log line or an
    #: exception message that formats a request never carries a secret.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    source_ip: str = ""
    #: the route's tier (where ``classification.route_metadata`` points), if present.
    route_tier: str | None = None
    #: the route-metadata values the policy reads (``Policy.needed_route_metadata``):
    #: (namespace, path) -> string, number or boolean; only those found.
    route_metadata: Mapping[tuple[str, tuple[str | int, ...]], Any] = field(default_factory=dict)
    #: ``context_extensions`` (per-route check settings).
    context_extensions: Mapping[str, str] = field(default_factory=dict)
    #: the ``x-request-id`` header (Envoy's own stream id is not useful to people).
    request_id: str = ""
    #: authenticated metadata by namespace (``metadata_context.filter_metadata[ns]`` as plain
    #: nested dicts of str/float/bool), only the namespaces and paths the policy names.
    metadata: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: the authenticated peer principal (mTLS: URI SAN, e.g. a SPIFFE id), if any.
    principal: str = field(default="", repr=False)
    #: a rate limit descriptor's entries, key -> value (``ShouldRateLimit``; empty on a Check):
    #: the values of a limiter's ``descriptor`` key parts.
    descriptor: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: the limiter with ``match`` the descriptor reached (``Policy.descriptors``), by name:
    #: the one limiter that runs on it; None on a Check (no limiter with ``match`` runs).
    descriptor_target: str | None = None
    #: what the descriptor adds to its limiter's count (``hits_addend``; 0: a check that adds
    #: nothing, as envoyproxy/ratelimit's; None: the limiter's ``cost``)
    hits: int | None = None
    #: the lease id the request's leases are held under ("": the engine makes one): the
    #: descriptors of one ``ShouldRateLimit`` share one, answered in one lease metadata
    lease_id: str = ""
    #: the numbers the descriptor's own ``limit`` sets for its target (Envoy's override of a
    #: quota's limit); None: the policy's
    descriptor_limits: Limits | None = None


@dataclass(frozen=True, slots=True)
class RequestContext:
    tier: Tier
    #: a keyed hash of the identity value; the raw value never leaves the classifier.
    identity: str
    #: which identity rule matched: ``header:x-api-key``, ``metadata:NS:a.b``, ``principal``,
    #: ``source_ip``, or ``none``.
    identity_source: str
    test_mode: bool
    method: str
    path: str
    host: str
    #: why this tier: ``test_mode``, ``route_metadata``, ``context_extensions``,
    #: ``rule[N]`` or ``default``.
    tier_source: str
    request_id: str = ""
    #: the raw headers the policy's matchers read (may hold the identity header): not in repr.
    headers: Mapping[str, str] = field(default_factory=lambda: _EMPTY, repr=False)
    #: the customer's plan (policy ``plan``): a name the policy knows, or ``""`` without a
    #: ``plan`` section (every limiter's own numbers).
    plan: str = ""
    #: where the plan came from: the rule's label (``header:x-plan``), ``default`` (no
    #: rule named one) or ``unknown`` (a rule named a plan the policy does not know: the
    #: default plan is used and the request counted).
    plan_source: str = ""
    #: live overrides for this identity, by limiter name (``extauthz.control.overrides``): each a
    #: mapping plan -> that limiter's numbers. Empty for nearly every request.
    overrides: Mapping[str, Mapping[str, Limits]] = field(default_factory=lambda: _NO_OVERRIDES)
    #: the values of the policy's limiter keys (``Policy.keys``, same order), each a keyed
    #: hash like ``identity`` and whether a part yielded nothing (then the hash is the
    #: key's shared bucket, for ``on_missing_key: shared``).
    keys: tuple[tuple[str, bool], ...] = ()
    #: ``RawRequest.descriptor_target``: set, the request is one rate limit descriptor and
    #: only that limiter applies; None, a checked request (limiters with ``match`` do not apply).
    descriptor_target: str | None = None
    #: ``RawRequest.hits``: the cost this request takes instead of its limiter's (None: the
    #: limiter's ``cost``; 0: checked, nothing added); only a rate limit descriptor sets it.
    hits: int | None = None
    #: ``RawRequest.lease_id``: the id its leases are held under ("": the engine makes one)
    lease_id: str = ""

    def cost(self, own: _N) -> _N:
        """What this request takes from a limiter whose own cost is ``own``: ``hits`` when set."""
        return own if self.hits is None else self.hits
