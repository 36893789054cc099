"""Conversion at the edge: CheckRequest -> RawRequest, Decision -> CheckResponse.

The only module that reads Envoy's attribute chains or builds Envoy's messages; the header
names it reads are :mod:`extauthz.envoy.headers`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import struct_pb2

from ..core.context import REQUEST_ID_HEADER, RawRequest, RequestContext
from ..core.tiers import Tier
from ..core.verdict import Decision
from ..engine.answers import (
    LEASE_FIELDS,
    TIER_HEADER,
    denial,
    lease_fields,
    ratelimit_headers,
)
from ..policy.classify import route_metadata_values, scalars_at
from ..policy.model import RouteRef
from ..proto import auth_pb2, core_pb2, http_status_pb2, status_pb2

_OVERWRITE = core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_GRPC_OK = 0
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14
_EMPTY: Mapping[str, str] = {}
_NO_METADATA: Mapping[str, tuple[tuple[str, ...], ...]] = {}


def raw_request(req: auth_pb2.CheckRequest, needed: frozenset[str], route: Sequence[RouteRef],
                metadata: Mapping[str, Sequence[Sequence[str]]] = _NO_METADATA) -> RawRequest:
    """``route``: the route-metadata values to extract (``Policy.needed_route_metadata``), the
    tier's first; ``metadata``: the filter-metadata namespaces and paths to extract (only
    those: the request path pays for what the policy reads)."""
    attrs = req.attributes
    http = attrs.request.http
    headers = http.headers
    path = http.path
    q = path.find("?")
    if q >= 0:
        path = path[:q]
    route_values = route_metadata_values(attrs.route_metadata_context.filter_metadata, route)
    tier = route_values.get(route[0]) if route else None
    route_tier = tier if isinstance(tier, str) else None
    ext = attrs.context_extensions
    found: Mapping[str, Any] = _EMPTY
    if metadata:
        md = attrs.metadata_context.filter_metadata
        found = {ns: scalars_at(md[ns], paths) for ns, paths in metadata.items() if ns in md}
    return RawRequest(
        method=http.method,
        path=path,
        host=http.host,
        headers={h: headers[h] for h in needed if h in headers},
        source_ip=attrs.source.address.socket_address.address,
        route_tier=route_tier,
        route_metadata=route_values,
        context_extensions=dict(ext) if ext else _EMPTY,
        request_id=headers.get(REQUEST_ID_HEADER, ""),
        metadata=found,
        principal=attrs.source.principal,
    )


def _header(key: str, value: str) -> core_pb2.HeaderValueOption:
    return core_pb2.HeaderValueOption(
        header=core_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE
    )


def _fill_lease_metadata(md: struct_pb2.Struct, decision: Decision, ticket: str) -> None:
    # Field by field: Struct.update() walks Python values through protobuf's pure-Python
    # well-known-type helpers (about 3x slower).
    fields = md.fields
    for name, value in lease_fields(decision, ticket):
        fields[name].string_value = value


def _ok_template(tier: str) -> auth_pb2.CheckResponse:
    return auth_pb2.CheckResponse(
        status=status_pb2.Status(code=_GRPC_OK),
        ok_response=auth_pb2.OkHttpResponse(headers=[_header(TIER_HEADER, tier)]),
    )


#: The constant part of an OK answer per tier, built once and copied (one C-level copy
#: instead of building four nested messages per request).
_OK_TEMPLATES = {tier.value: _ok_template(tier.value) for tier in Tier}


def check_response(ctx: RequestContext, decision: Decision, ticket: str = "") -> auth_pb2.CheckResponse:
    """``ticket``: the lease ticket (extauthz/engine/tickets.py) put beside the leases."""
    if decision.allowed:
        resp = auth_pb2.CheckResponse()
        template = _OK_TEMPLATES.get(ctx.tier.value)
        resp.CopyFrom(template if template is not None else _ok_template(ctx.tier.value))
        headers = ratelimit_headers(decision)
        if headers:
            add = resp.ok_response.response_headers_to_add.add
            for k, v in headers:
                add(header=core_pb2.HeaderValue(key=k, value=v), append_action=_OVERWRITE)
        if decision.leases:
            _fill_lease_metadata(resp.dynamic_metadata, decision, ticket)
        return resp
    d = denial(ctx, decision)
    code = _GRPC_RESOURCE_EXHAUSTED if d.status == 429 else _GRPC_UNAVAILABLE
    return auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code, message=decision.denied_by.reason if decision.denied_by else ""),
        denied_response=auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=d.status),  # type: ignore[arg-type]
            headers=[_header(k, v) for k, v in d.headers],
            body=d.body,
        ),
    )


def lease_metadata(md: struct_pb2.Struct) -> dict[str, str | None]:
    """The lease fields an access-log entry's ext_authz namespace holds (None: present but not
    a string), for :meth:`~extauthz.server.leases.FinishedEntries.entry`: the same fields
    whichever edge (gRPC or HTTP) answered the check (``answers.lease_fields``)."""
    fields = md.fields
    return {name: (v.string_value if v.WhichOneof("kind") == "string_value" else None)
            for name in LEASE_FIELDS if (v := fields.get(name)) is not None}
