"""Envoy's HTTP authorization protocol (``http_service``), mapped: the request Envoy sends ->
:class:`~extauthz.core.context.RawRequest`, a decision -> the HTTP/1.1 answer.

Envoy sends the client's method, path and the headers its ``allowed_headers`` lists, without
the body; a 200 admits the request, any other status is the client's answer (docs/http.md has
the field-by-field mapping to the gRPC protocol). The request is converted once into the same
:class:`~extauthz.core.context.RawRequest` the gRPC edge builds, and answered from the same pieces
(:mod:`extauthz.engine.answers`). Pure functions: the connection is ``server/http.py``'s, the check
flow ``server/flow.py``'s.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.context import REQUEST_ID_HEADER, RawRequest, RequestContext
from ..core.verdict import Decision
from ..engine.answers import TIER_HEADER, denial, lease_fields, ratelimit_headers
from ..envoy.headers import (
    FORWARDED_FOR_HEADER,
    JWT_NAMESPACE,
    JWT_PAYLOAD_HEADER,
    JWT_PAYLOAD_KEY,
    ROUTE_TIER_HEADER,
    SHED_STATUS,
    XFCC_HEADER,
)
from ..policy.classify import scalars_at

_EMPTY: Mapping[str, str] = {}
_NO_METADATA: Mapping[str, Sequence[Sequence[str]]] = {}
_REASONS = {200: b"OK", 400: b"Bad Request", 408: b"Request Timeout", 420: b"Shedding Load",
            429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error"}


# ---- the request: HTTP -> RawRequest ----------------------------------------------------


def source_ip(forwarded_for: str) -> str:
    """The last ``x-forwarded-for`` entry: the address Envoy saw (Envoy appends it with
    ``use_remote_address: true``; entries before it are the client's own claims)."""
    if not forwarded_for:
        return ""
    return forwarded_for.rpartition(",")[2].strip()


def _split_quoted(text: str, sep: str) -> list[str]:
    out, cur, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            cur.append(ch)
            escaped = False
        elif ch == "\\" and quoted:
            cur.append(ch)
            escaped = True
        elif ch == '"':
            quoted = not quoted
            cur.append(ch)
        elif ch == sep and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def xfcc_principal(value: str) -> str:
    """The ``URI=`` of the last element of an ``x-forwarded-client-cert`` header: the peer
    Envoy itself authenticated (with ``SANITIZE_SET`` it is the only element; with
    ``APPEND_FORWARD`` earlier elements are what further proxies claimed). Empty if none."""
    if not value:
        return ""
    last = _split_quoted(value, ",")[-1]
    for pair in _split_quoted(last, ";"):
        key, eq, val = pair.partition("=")
        if eq and key.strip().lower() == "uri":
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] == '"':
                val = val[1:-1].replace('\\"', '"')
            return val
    return ""


def jwt_payload(value: str) -> dict[str, Any] | None:
    """The JSON object ``jwt_authn`` forwards (base64url, padding optional), or None."""
    if not value or len(value) > 16 * 1024:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (ValueError, binascii.Error):
        return None
    return data if isinstance(data, dict) else None


def http_metadata(headers: Mapping[str, str],
                  needed: Mapping[str, Sequence[Sequence[str]]]) -> dict[str, Any]:
    """The authenticated metadata the HTTP protocol carries, keyed by namespace like the gRPC
    protocol's ``metadata_context``: the JWT payload ``jwt_authn`` forwarded
    (``forward_payload_header``), filed as ``payload_in_metadata: payload`` would file it."""
    paths = needed.get(JWT_NAMESPACE)
    if not paths or JWT_PAYLOAD_HEADER not in headers:
        return {}
    payload = jwt_payload(headers[JWT_PAYLOAD_HEADER])
    if payload is None:
        return {}
    return {JWT_NAMESPACE: scalars_at({JWT_PAYLOAD_KEY: payload}, paths)}


def client_path(path: str, prefix: str) -> str:
    """The client's path from the one Envoy sent: ``http_service.path_prefix`` (Envoy Gateway's
    SecurityPolicy ``extAuth.http.path``) + the client's path. A path without the prefix (or
    where it is only the start of a longer segment, ``/authors`` for ``/auth``) is the client's."""
    if prefix and path.startswith(prefix):
        rest = path[len(prefix):]
        if not rest or rest[0] == "/":
            return rest or "/"
    return path


def raw_request(method: str, target: str, headers: Mapping[str, str],
                needed: Iterable[str], *, forward_auth: bool = False, prefix: str = "",
                metadata: Mapping[str, Sequence[Sequence[str]]] = _NO_METADATA) -> RawRequest:
    """The HTTP authorization request as the engine sees it (the one conversion).

    ``metadata``: the namespaces and paths the policy reads (``Classifier.needed_metadata``):
    only the forwarded JWT payload is decoded, and only when the policy reads it.
    ``prefix``: the ``path_prefix`` Envoy puts before the client's path (:func:`client_path`).
    ``forward_auth``: the proxy sends every check as ``GET <its address>`` and the client's
    request in ``X-Forwarded-Method`` / ``X-Forwarded-Uri`` / ``X-Forwarded-Host`` (Traefik's
    ForwardAuth); only for proxies that set those themselves (never for Envoy, which sends the
    client's method and path as they are).
    """
    if forward_auth:
        method = headers.get("x-forwarded-method", method)
        target = headers.get("x-forwarded-uri", target)
        host = headers.get("x-forwarded-host")
        if host is not None:
            headers = {**headers, "host": host}
    q = target.find("?")
    path = target[:q] if q >= 0 else target
    if prefix:
        path = client_path(path, prefix)
    return RawRequest(
        method=method,
        path=path,
        host=headers.get("host", ""),
        headers={h: headers[h] for h in needed if h in headers},
        source_ip=source_ip(headers.get(FORWARDED_FOR_HEADER, "")),
        route_tier=headers.get(ROUTE_TIER_HEADER),
        context_extensions=_EMPTY,
        request_id=headers.get(REQUEST_ID_HEADER, ""),
        metadata=http_metadata(headers, metadata) if metadata else _EMPTY,
        principal=xfcc_principal(headers.get(XFCC_HEADER, "")),
    )


# ---- the answer: Decision -> HTTP ------------------------------------------------------


def head(status: int, headers: Iterable[tuple[str, str]], length: int, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, _REASONS.get(status, b"Refused"), length)]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def http_answer(ctx: RequestContext, decision: Decision, *, close: bool = False, ticket: str = "") -> bytes:
    """The whole HTTP/1.1 response for a decision, from the same pieces as the gRPC answer:
    allowed -> 200 with the tier header (for the upstream), the RateLimit headers (for the
    client) and the lease fields (for Envoy's dynamic metadata); refused -> the denial's
    status (503 as :data:`SHED_STATUS`), headers and problem+json body."""
    if decision.allowed:
        headers = [(TIER_HEADER, ctx.tier.value), *ratelimit_headers(decision), *lease_fields(decision, ticket)]
        return head(200, headers, 0, close)
    d = denial(ctx, decision)
    body = d.body.encode()
    status = SHED_STATUS if d.status == 503 else d.status
    return head(status, d.headers, len(body), close) + body


def error_answer(status: int) -> bytes:
    """The answer to a request the protocol refused (``status``), closing the connection."""
    return head(status, (), 0, True)
