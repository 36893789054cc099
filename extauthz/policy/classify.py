"""Identity extraction and tier classification: RawRequest -> RequestContext.

Tier precedence: test mode, route metadata, a rate limit descriptor's tier entry
(``classification.descriptor_key``), context extensions, policy rules, then the
method default (GET/HEAD/OPTIONS are ``get``, everything else ``post``). An unknown tier
name in metadata or extensions is ignored (and counted by the caller), never trusted.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.context import RawRequest, RequestContext, host_name
from ..core.tiers import READ_METHODS, Tier
from ..core.verdict import Limits
from ..store.keys import IDENTITY_HASH_PATTERN
from .model import IdentitySource, KeySource, MetadataTest, Policy, RouteRef

_TIERS = {t.value: t for t in Tier}
#: live overrides as the classifier reads them: identity hash -> limiter -> plan -> numbers.
OverrideTable = Mapping[str, Mapping[str, Mapping[str, Limits]]]
_NO_OVERRIDES: OverrideTable = {}
_NO_LIMITS: Mapping[str, Mapping[str, Limits]] = {}


def hash_identity(value: str, source: str, salt: bytes = b"") -> str:
    """A keyed BLAKE2b digest: stable across replicas, irreversible without the salt."""
    h = hashlib.blake2b(digest_size=12, key=salt[:64])
    h.update(source.encode())
    h.update(b"\0")
    h.update(value.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


#: a hashed identity as every command and log shows it (:func:`hash_identity`: 12 bytes, hex)
IDENTITY_HASH = re.compile(IDENTITY_HASH_PATTERN)


def valid_hash(value: str) -> bool:
    """``value`` is an identity hash (24 hex digits; give it lower-cased, as
    :func:`normal_hash` does): the one check every command and the admin port use."""
    return IDENTITY_HASH.fullmatch(value) is not None


def normal_hash(value: str) -> str | None:
    """``value`` (trimmed, any case) as an identity hash, or None when it is not one."""
    value = value.strip().lower()
    return value if valid_hash(value) else None


class AmbiguousKey(ValueError):
    """A key that holds different values separated by ",": the server reads such a header
    as repeated with different values, never as one identity."""


def key_identity_hash(raw: str, rule: IdentitySource | None, source: str, salt: bytes = b"") -> str:
    """A key (an API key, a customer's identity value) an operator gives a command, hashed as
    the server hashes it for the identity rule ``rule`` (label ``source``): the one place
    ``extauthz hash``, ``inspect``, ``override``, ``report --identities`` and ``simulate
    --identities`` turn a key into its hash. For a header rule the key is read as the
    header's value (:func:`header_value`: trimmed, the ``strip_prefix`` removed when the key
    carries it); raises :class:`AmbiguousKey` for a value the server never hashes as one."""
    if rule is not None and rule.header is not None:
        text = header_text(raw)
        if text == AMBIGUOUS:
            raise AmbiguousKey("the key holds different values separated by ',': the server reads "
                               "such a header as repeated with different values, never as one identity")
        raw = header_value(rule, raw) or text
    return hash_identity(raw, source, salt)


def path_value(node: Any, path: Sequence[str | int]) -> Any:
    """The value at ``path`` in ``node``, or None: the ONE walk through metadata (filter or
    route metadata; plain dicts and lists, or protobuf Structs and ListValues, which are
    Mappings and Sequences). A string follows a mapping's key, an integer a list's index
    (``[resources, 0, annotations, extauthz-tier]``); anything else on the way yields None."""
    for key in path:
        if isinstance(key, int):
            if isinstance(node, (str, bytes)) or not isinstance(node, Sequence) or not 0 <= key < len(node):
                return None
            node = node[key]
        elif isinstance(node, Mapping) and key in node:
            node = node[key]
        else:
            return None
    return node


def metadata_value(metadata: Mapping[str, Any], namespace: str, path: Sequence[str | int]) -> Any:
    """The value at ``path`` in ``metadata[namespace]``, or None (:func:`path_value`)."""
    return path_value(metadata.get(namespace), path)


def scalars_at(root: Any, paths: Iterable[Sequence[str]]) -> dict[str, Any]:
    """Only the scalars at ``paths`` of ``root`` (:func:`path_value`), as nested dicts (e.g.
    ``{"payload": {"sub": "alice"}}``): what either edge copies into ``RawRequest.metadata``,
    from a protobuf Struct (gRPC) or a forwarded JWT payload's JSON (HTTP). Numbers as floats,
    as a Struct holds them, so that one value is one identity on either edge. The cost follows
    the paths, not the size of ``root``."""
    out: dict[str, Any] = {}
    for path in paths:
        value = path_value(root, path) if path else None
        if isinstance(value, bool | str):
            pass
        elif isinstance(value, int | float):
            value = float(value)
        else:
            continue
        into = out
        for key in path[:-1]:
            sub = into.setdefault(key, {})
            if not isinstance(sub, dict):
                break
            into = sub
        else:
            into[path[-1]] = value
    return out


def route_metadata_values(metadata: Mapping[str, Any], refs: Sequence[RouteRef]) -> dict[RouteRef, Any]:
    """The scalars (string, number, boolean) at ``refs`` in a route's filter metadata
    (namespace -> struct): what the edge copies into ``RawRequest.route_metadata``."""
    out: dict[RouteRef, Any] = {}
    for ref in refs:
        namespace, path = ref
        if namespace in metadata:
            value = path_value(metadata[namespace], path)
            if isinstance(value, (str, int, float)):  # bool is an int
                out[ref] = value
    return out


def identity_text(value: Any) -> str:
    """A metadata value as an identity: a string as is, a number as its decimal text
    (``42``, not ``42.0``; protobuf Structs carry every number as a double); anything else
    (booleans, lists, structs, non-finite numbers) yields nothing."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() and abs(value) < 2**63 else repr(value)
    return ""


def _equals(value: Any, wanted: str | int | float | bool) -> bool:
    if isinstance(wanted, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(wanted, bool) and value is wanted
    if isinstance(wanted, (int, float)):
        return isinstance(value, (int, float)) and value == wanted
    return isinstance(value, str) and value == wanted


def metadata_test(raw: RawRequest, spec: MetadataTest | None) -> bool:
    return spec is not None and _equals(metadata_value(raw.metadata, spec.namespace, spec.path), spec.equals)


#: what a header rule yields when the header carries different values (repeated with
#: different values, which both doors deliver joined with ","): one value no header can hold
#: (NUL), so that every such request of a key or identity rule shares one bucket, and a
#: client cannot leave its bucket by repeating the header with another value.
AMBIGUOUS = "\x00"


def first_value(sources: Sequence[IdentitySource], raw: RawRequest, fold: bool = False) -> tuple[str, str]:
    """The value of the first rule that yields one, and that rule's label (``none``).

    One extraction for the ``identity`` and the ``plan`` rules (the same rule shapes) and the
    key parts that take those shapes (``fold``: their ``case: fold``, see :func:`header_text`).
    """
    for src in sources:
        if src.source_ip:
            if raw.source_ip:
                return raw.source_ip, "source_ip"
            continue
        if src.principal:
            if raw.principal:
                return folded(raw.principal, fold), "principal"
            continue
        if src.metadata is not None:
            text = identity_text(metadata_value(raw.metadata, *src.metadata))
            if text:
                return folded(text, fold), src.label
            continue
        value = header_value(src, raw.headers.get(src.header or ""), fold)
        if not value:
            continue
        return value, src.label
    return "", "none"


def folded(value: str, fold: bool) -> str:
    """``value`` case-folded (``case: fold``), or as is."""
    return value.casefold() if fold else value


def header_text(value: str, fold: bool = False) -> str:
    """A header's value as a key or identity: trimmed (leading and trailing whitespace), and
    case-folded with ``fold``; a header repeated (both doors join repeats with ",", as HTTP
    joins a list) is one value when its elements are the same (``acme, acme`` is ``acme``;
    empty elements are ignored, as HTTP says), else :data:`AMBIGUOUS`. A value that holds a
    comma of its own is read the same way: key on headers whose values hold none."""
    if "," not in value:
        return folded(value.strip(), fold)
    values = {folded(v.strip(), fold) for v in value.split(",")}
    values.discard("")
    if len(values) > 1:
        return AMBIGUOUS
    return values.pop() if values else ""


def header_value(src: IdentitySource, value: str | None, fold: bool = False) -> str:
    """A header rule's value (:func:`header_text`): with ``strip_prefix``, the rest after that
    prefix (any case), trimmed; a value without the prefix yields nothing (``""``)."""
    if not value:
        return ""
    value = header_text(value, fold)
    if src.strip_prefix is None or value == AMBIGUOUS:
        return value
    prefix = src.strip_prefix
    if value[: len(prefix)].lower() != prefix.lower():
        return ""
    return value[len(prefix):].strip()


def key_part_value(part: KeySource, raw: RawRequest, identity: str, method: str, plan: str) -> str:
    """One key part's value for a request ("" when it yields none); ``identity`` is the
    hashed identity, ``method`` upper case, ``plan`` the request's plan; the ``host`` part
    yields the Host's name (:func:`~extauthz.core.context.host_name`); a part with
    ``case: fold`` is case-folded."""
    kind = part.kind
    if part.source is not None:
        return first_value((part.source,), raw, part.fold)[0]
    if kind == "identity":
        return identity
    if kind == "method":
        return method
    if kind == "host":
        return host_name(raw.host)
    if kind == "plan":
        return plan
    if kind == "context_extension":
        return folded(raw.context_extensions.get(part.name, ""), part.fold)
    if kind == "descriptor":
        return folded(raw.descriptor.get(part.name, ""), part.fold)
    value = identity_text(raw.route_metadata.get(part.route)) if part.route is not None else ""
    if not value and kind == "route":
        value = raw.context_extensions.get("route", "")
    return folded(value, part.fold)


def _key_text(values: Sequence[str]) -> str:
    """The parts' values as one unambiguous string (each length-prefixed)."""
    return "".join(f"{len(v)}:{v}" for v in values)


class Classifier:
    __slots__ = ("_keys", "_needed", "_needed_metadata", "_overrides", "_policy", "_salt", "_shared",
                 "unknown_plans", "unknown_tiers")

    def __init__(self, policy: Policy, salt: bytes = b"", overrides: OverrideTable = _NO_OVERRIDES) -> None:
        self._policy = policy
        self._salt = salt
        self._needed = policy.needed_headers
        self._needed_metadata = policy.needed_metadata
        self._overrides = overrides
        self._keys = policy.keys
        #: each key's shared bucket (``on_missing_key: shared``), hashed once.
        self._shared = tuple(hash_identity("", spec.label + ":missing", salt) for spec in policy.keys)
        #: count of tier names in metadata/extensions that were not a known tier.
        self.unknown_tiers = 0
        #: count of plan values the policy does not name (the default plan was used).
        self.unknown_plans = 0

    @property
    def needed_headers(self) -> frozenset[str]:
        return self._needed

    @property
    def needed_metadata(self) -> Mapping[str, tuple[tuple[str, ...], ...]]:
        """Filter-metadata namespace -> paths the policy reads (the edge copies only these)."""
        return self._needed_metadata

    def identity(self, raw: RawRequest) -> tuple[str, str]:
        """The raw identity value and the label of the rule that produced it."""
        return first_value(self._policy.identity, raw)

    def plan(self, raw: RawRequest) -> tuple[str, str]:
        """The request's plan and where it came from (see ``RequestContext.plan_source``)."""
        policy = self._policy
        if not policy.plan_sources:
            return "", ""
        value, label = first_value(policy.plan_sources, raw)
        if not value:
            return policy.plan_default, "default"
        name = value.strip().lower()
        if name in policy.plan_names:
            return name, label
        self.unknown_plans += 1
        return policy.plan_default, "unknown"

    def keys(self, raw: RawRequest, identity: str, method: str, plan: str) -> tuple[tuple[str, bool], ...]:
        """The values of the policy's limiter keys for a request (``RequestContext.keys``):
        a keyed hash of the parts' values, or the key's shared bucket when a part yields none."""
        out: list[tuple[str, bool]] = []
        for i, spec in enumerate(self._keys):
            values = [key_part_value(part, raw, identity, method, plan) for part in spec.parts]
            if all(values):
                out.append((hash_identity(_key_text(values), spec.label, self._salt), False))
            else:
                out.append((self._shared[i], True))
        return tuple(out)

    def _known(self, name: object) -> Tier | None:
        if not isinstance(name, str) or not name:
            return None
        tier = _TIERS.get(name.strip().lower())
        if tier is None:
            self.unknown_tiers += 1
        return tier

    def context(self, raw: RawRequest) -> RequestContext:
        policy = self._policy
        value, source = self.identity(raw)
        method = raw.method.upper()
        test_mode = bool(
            (policy.test_key_prefix and source != "source_ip" and value.startswith(policy.test_key_prefix))
            or (policy.test_header and raw.headers.get(policy.test_header, "").lower() == "true")
            or metadata_test(raw, policy.test_metadata)
        )
        tier: Tier | None
        if test_mode:
            tier, why = Tier.TEST, "test_mode"
        else:
            tier, why = self._known(raw.route_tier), "route_metadata"
            if tier is None and raw.descriptor:  # a rate limit descriptor's tier entry
                tier, why = self._known(raw.descriptor.get(policy.descriptor_tier_key)), "descriptor"
            if tier is None:
                tier = self._known(raw.context_extensions.get(policy.context_extension_key))
                why = "context_extensions"
            if tier is None:
                for i, rule in enumerate(policy.rules):
                    if rule.matcher.matches(method, raw.path, raw.host, raw.headers):
                        tier, why = rule.tier, f"rule[{i}]"
                        break
            if tier is None:
                tier = Tier.GET if method in READ_METHODS else Tier.POST
                why = "default"
        identity = hash_identity(value, source, self._salt)
        plan, plan_source = self.plan(raw)
        return RequestContext(
            tier=tier,
            identity=identity,
            identity_source=source,
            test_mode=test_mode,
            method=method,
            path=raw.path,
            host=raw.host,
            tier_source=why,
            request_id=raw.request_id,
            headers=raw.headers,
            plan=plan,
            plan_source=plan_source,
            overrides=(self._overrides.get(identity, _NO_LIMITS) if self._overrides else _NO_LIMITS)
            if raw.descriptor_limits is None or raw.descriptor_target is None
            else {raw.descriptor_target: {"": raw.descriptor_limits}},
            keys=self.keys(raw, identity, method, plan) if self._keys else (),
            descriptor_target=raw.descriptor_target,
            hits=raw.hits,
            lease_id=raw.lease_id,
        )
