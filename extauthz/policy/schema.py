"""The policy file schema: strict, typed, and the source of the published JSON Schema.

Every model forbids unknown keys. Durations and rates are parsed here, once, so the
request path only reads numbers. See ``docs/policy.md`` for the field reference.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

# -- number bounds ------------------------------------------------------------------------
# Every number that enters (a policy file, an override from the CLI or the admin port, an
# override read back from the store) is finite and within these bounds, so nothing derived
# from it (a bucket's refill time, a key's TTL, a Retry-After header) can overflow or grow
# absurd. docs/policy.md and docs/security.md list them.

#: tokens per second: at least one per ~11.6 days, at most a billion.
MIN_RATE = 1e-6
MAX_RATE = 1e9
#: ``burst`` and ``cost`` (tokens).
MAX_TOKENS = 1e9
#: ``burst / rate``: a bucket refills from empty within 30 days (so a Retry-After, and a
#: bucket key's TTL of twice that, stay bounded).
MAX_REFILL = 30 * 86400.0
#: in-flight counts: ``limit``, ``capacity``, ``signal.capacity`` (a billion: "unlimited" fits).
MAX_COUNT = 1_000_000_000
#: every duration of a policy (``lease_ttl``, ``sample_interval``, ...): at most a day.
MAX_DURATION = 86400.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")


def _number_or_text(value: Any, pattern: re.Pattern[str], combine: Callable[[float, float], float],
                    what: str, use: str, must: str) -> Any:
    """A number as it is, or a string ``pattern`` matches: its number ``combine``-d with its
    unit's seconds; else ``bad WHAT 'x': use USE`` (a string) or ``a WHAT must be MUST``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"a {what} must be {must}")
    m = pattern.match(value)
    if m is None:
        raise ValueError(f"bad {what} {value!r}: use {use}")
    return combine(float(m.group(1)), _UNIT_SECONDS[m.group(2)])


def parse_duration(value: Any) -> Any:
    """``"60s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a number of seconds."""
    return _number_or_text(value, _DURATION, operator.mul, "duration",
                           "a number of seconds or a string like '500ms', '60s', '2m', '1h'",
                           "a number of seconds or a string like '60s'")


def parse_rate(value: Any) -> Any:
    """A number of tokens per second, or ``"100/s"``, ``"6000/m"``, ``"10/h"``."""
    return _number_or_text(value, _RATE, operator.truediv, "rate",
                           "a number per second or '100/s', '6000/m'",
                           "a number (per second) or a string like '100/s'")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _RATE.match(value)
        if m is None:
            raise ValueError(f"bad rate {value!r}: use a number per second or '100/s', '6000/m'")
        return float(m.group(1)) / _UNIT_SECONDS[m.group(2)]
    raise ValueError("a rate must be a number (per second) or a string like '100/s'")


def _upper_methods(value: Any) -> Any:
    if isinstance(value, list):
        return [v.upper() if isinstance(v, str) else v for v in value]
    return value


Duration = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION),
    WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0, "maximum": MAX_DURATION},
                              {"type": "string", "pattern": _DURATION.pattern}],
                    "description": "seconds, or a string like '500ms', '60s', '2m', '1h'"}),
]
Rate = Annotated[
    float, BeforeValidator(parse_rate), Field(ge=MIN_RATE, le=MAX_RATE),
    WithJsonSchema({"anyOf": [{"type": "number", "minimum": MIN_RATE, "maximum": MAX_RATE},
                              {"type": "string", "pattern": _RATE.pattern}],
                    "description": "per second, or a string like '100/s', '6000/m'"}),
]
Tokens = Annotated[float, Field(gt=0, le=MAX_TOKENS)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Methods = Annotated[list[str], BeforeValidator(_upper_methods)]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]
# Literals rather than enums: strict validation of Python input accepts no strings for enums.
TierName = Literal["critical", "post", "get", "test"]
ModeName = Literal["enforce", "shadow", "off"]


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf`, `.nan` (YAML) and `Infinity` (JSON) are refused everywhere.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


MetadataPath = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=16)]


#: a path in route metadata: keys through nested structs and indexes into lists
#: (Envoy Gateway files a route's resources as a list: ``[resources, 0, annotations, x]``).
def _path_item(value: Any) -> Any:
    if (isinstance(value, str) and value) or (type(value) is int and value >= 0):
        return value
    raise ValueError("a path item is a key (a non-empty string) or a list index (an integer >= 0)")


RouteMetadataPath = Annotated[
    list[Annotated[str | int, BeforeValidator(_path_item),
                   WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                             {"type": "integer", "minimum": 0}]})]],
    Field(min_length=1, max_length=16),
]


class RouteMetadataRef(_Strict):
    """A value in the route's ``metadata.filter_metadata`` (the CheckRequest's
    ``route_metadata_context``)."""

    namespace: str = Field(
        min_length=1, description="filter_metadata namespace of the route, e.g. 'envoy-gateway' "
        "(the ext_authz filter must list it in 'route_metadata_context_namespaces')."
    )
    path: RouteMetadataPath = Field(
        description="Keys followed through nested structs and indexes into lists, e.g. "
        "[resources, 0, annotations, extauthz-tier]."
    )


class MetadataRef(_Strict):
    """A value in the CheckRequest's ``metadata_context.filter_metadata``."""

    namespace: str = Field(
        min_length=1, description="filter_metadata namespace, e.g. 'envoy.filters.http.jwt_authn' "
        "(the ext_authz filter must list it in 'metadata_context_namespaces')."
    )
    path: MetadataPath = Field(
        description="Keys followed through nested structs, e.g. [payload, sub]."
    )


class IdentityRule(_Strict):
    """One way to name the user. The first rule that yields a value wins."""

    header: str | None = Field(None, description="Request header holding the identity.")
    strip_prefix: str | None = Field(
        None, description="Prefix removed from the header value (e.g. 'Bearer '); "
        "a value without it yields nothing."
    )
    source_ip: bool = Field(False, description="Use the downstream peer address.")
    metadata: MetadataRef | None = Field(
        None, description="A string or number in the request's filter metadata (e.g. the JWT "
        "'sub' that jwt_authn verified); anything else yields nothing."
    )
    principal: bool = Field(
        False, description="The peer principal Envoy reports from mTLS (Istio: the SPIFFE id)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> IdentityRule:
        sources = (self.header is not None) + self.source_ip + (self.metadata is not None) + self.principal
        if sources != 1:
            raise ValueError("an identity rule names exactly one of 'header', 'metadata', "
                             "'principal: true' or 'source_ip: true'")
        if self.strip_prefix is not None and self.header is None:
            raise ValueError("'strip_prefix' needs 'header'")
        return self


def _scalar_only(value: Any) -> Any:
    if not isinstance(value, (str, int, float, bool)):
        raise ValueError("'equals' is a string, a number or a boolean")
    return value


class TestModeMetadata(MetadataRef):
    """Test mode when a filter-metadata value equals ``equals`` (e.g. a claim ``livemode: false``)."""

    __test__ = False  # not a pytest test class

    equals: Annotated[str | int | float | bool, BeforeValidator(_scalar_only)] = Field(
        description="The value meaning test mode; strings compare exactly, numbers by value, "
        "booleans only with booleans."
    )
def _true_only(value: Any) -> Any:
    if value is not True:
        raise ValueError("a key part's flag is 'true' (leave the part out otherwise)")
    return value


TrueFlag = Annotated[bool, BeforeValidator(_true_only)]


# -- rate limit descriptors (Envoy's ratelimit filter; extauthz.policy.descriptors) ---------

#: entries in one descriptor a limiter matches (Envoy sends a few; envoyproxy/ratelimit's
#: configs nest a handful of levels)
MAX_DESCRIPTOR_ENTRIES = 16
#: the longest descriptor key (and domain) and value a limiter matches
MAX_DESCRIPTOR_KEY = 256
MAX_DESCRIPTOR_VALUE = 1024
DescriptorKey = Annotated[str, Field(min_length=1, max_length=MAX_DESCRIPTOR_KEY)]


class DescriptorEntryMatch(_Strict):
    """One entry of a descriptor: its key, and the value it must have (any value if unset)."""

    key: DescriptorKey = Field(description="The entry's key (a rate limit action's "
                               "descriptor_key, or its fixed key such as 'remote_address').")
    value: Annotated[str, Field(min_length=1, max_length=MAX_DESCRIPTOR_VALUE)] | None = Field(
        None, description="The value the entry must have; a value ending in '*' matches the "
        "values starting with what precedes it; unset: any value (the default for the values "
        "no sibling entry names).")


class DescriptorMatch(_Strict):
    """The rate limit descriptors (``ShouldRateLimit``) a limiter counts: a domain and the
    entries, in order. The most specific match wins, entry by entry, as envoyproxy/ratelimit
    decides (docs/ratelimit.md)."""

    domain: Annotated[str, Field(min_length=1, max_length=MAX_DESCRIPTOR_KEY)] = Field(
        description="The rate limit domain (the ratelimit filter's 'domain').")
    descriptor: list[DescriptorEntryMatch] = Field(
        min_length=1, max_length=MAX_DESCRIPTOR_ENTRIES,
        description="The descriptor's entries, in order: a descriptor matches only with as many "
        "entries.")


class UnlimitedSpec(_Strict):
    """A descriptor that no limit applies to (envoyproxy/ratelimit's ``unlimited: true``):
    answered OK, never counted, and it keeps the less specific limiters off the descriptor."""

    name: Name | None = Field(None, description="Its name, for another's 'replaces'.")
    match: DescriptorMatch
    replaces: list[Name] | None = Field(
        None, min_length=1, description="Limiters with 'match' this one switches off for the "
        "request, when both match its descriptors.")


#: names a rate limit header may not take: the response's framing and hop-by-hop headers
#: (RFC 9110 7.6.1, 6.4.1; RFC 9112 6.1): the filter adds the header to every answer, and a
#: second Content-Length or a Connection of the policy's making breaks or desyncs the response
RESERVED_HEADER_NAMES = frozenset({"connection", "content-length", "host", "keep-alive", "proxy-connection",
                                   "te", "trailer", "transfer-encoding", "upgrade"})


def _not_reserved(name: str) -> str:
    if name.lower() in RESERVED_HEADER_NAMES:
        raise ValueError(f"{name!r} frames the response or is hop-by-hop: a rate limit header needs another name")
    return name


#: a response header's name (an HTTP token, not one of :data:`RESERVED_HEADER_NAMES`)
ResponseHeaderName = Annotated[str, Field(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$"),
                               AfterValidator(_not_reserved)]


class RateLimitHeaderNames(_Strict):
    """The three headers of ``ratelimit_headers.style: counts`` (envoyproxy/ratelimit's
    ``LIMIT_LIMIT_HEADER``, ``LIMIT_REMAINING_HEADER``, ``LIMIT_RESET_HEADER``; their defaults)."""

    limit: ResponseHeaderName = Field("RateLimit-Limit", description="The limit (requests per unit).")
    remaining: ResponseHeaderName = Field("RateLimit-Remaining", description="What is left of it.")
    reset: ResponseHeaderName = Field("RateLimit-Reset", description="Seconds until its window ends.")

    @model_validator(mode="after")
    def _distinct(self) -> RateLimitHeaderNames:
        if len({self.limit.lower(), self.remaining.lower(), self.reset.lower()}) < 3:
            raise ValueError("the three header names must differ")
        return self


class RateLimitHeadersSpec(_Strict):
    """The rate limit headers a ``ShouldRateLimit`` answer asks the ratelimit filter to add
    (``response_headers_to_add``), of the descriptor over its limit, else the one closest to it."""

    style: Literal["ietf", "counts", "none"] = Field(
        "ietf", description="ietf: RateLimit-Policy and RateLimit (and Retry-After when over), as Check "
        "answers; counts: envoyproxy/ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED (limit, remaining, reset: "
        "'names'); none: no headers (the peer's default).")
    names: RateLimitHeaderNames | None = Field(
        None, description="With style counts: the three headers' names (default RateLimit-Limit, "
        "RateLimit-Remaining, RateLimit-Reset; X-RateLimit-* for Envoy's own names).")

    @model_validator(mode="after")
    def _names_with_counts(self) -> RateLimitHeadersSpec:
        if self.names is not None and self.style != "counts":
            raise ValueError("'names' applies to style 'counts' only")
        return self


#: the key parts whose value is text a client or a route chooses (``case: fold`` applies);
#: ``method`` is upper case, ``host`` and ``plan`` lower case already.
FOLDABLE_PARTS = ("header", "principal", "metadata", "route", "route_metadata", "context_extension",
                  "descriptor")


class KeyPart(_Strict):
    """One part of a limiter's key: exactly one field. A part that yields no value means
    the limiter does not apply to the request (or, with ``on_missing_key: shared``, that
    the request counts in one shared bucket)."""

    identity: TrueFlag | None = Field(None, description="The policy's identity (always yields).")
    header: str | None = Field(None, min_length=1, description="A request header's value.")
    strip_prefix: str | None = Field(
        None, description="With 'header': the prefix removed (e.g. 'Bearer '); a value "
        "without it yields nothing.")
    source_ip: TrueFlag | None = Field(None, description="The downstream peer address.")
    principal: TrueFlag | None = Field(None, description="The mTLS peer principal.")
    metadata: MetadataRef | None = Field(
        None, description="A string or number in the request's filter metadata (e.g. a "
        "verified JWT claim).")
    method: TrueFlag | None = Field(None, description="The request method (upper case).")
    host: TrueFlag | None = Field(None, description="The host, without port, lower case.")
    route: TrueFlag | None = Field(
        None, description="The route's name: 'route' in the classifier's route metadata "
        "namespace, else the context extension 'route'.")
    route_metadata: RouteMetadataRef | None = Field(
        None, description="A string or number in the route's metadata.")
    context_extension: str | None = Field(
        None, min_length=1, description="A per-route context extension, by name.")
    plan: TrueFlag | None = Field(None, description="The request's plan.")
    descriptor: DescriptorKey | None = Field(
        None, description="The value of a rate limit descriptor's entry, by its key (a limiter "
        "with 'match' only: Envoy's ratelimit filter, ShouldRateLimit).")
    case: Literal["fold"] | None = Field(
        None, description="'fold': the value case-folded ('ACME' and 'acme' are one key); "
        "only on a part whose value is text: " + ", ".join(f"'{f}'" for f in FOLDABLE_PARTS) + ".")

    @model_validator(mode="after")
    def _one_part(self) -> KeyPart:
        if self.strip_prefix is not None and self.header is None:
            raise ValueError("'strip_prefix' needs 'header'")
        if self.case is not None and not any(getattr(self, f) is not None for f in FOLDABLE_PARTS):
            raise ValueError("'case' applies only to a part whose value is text: "
                             + ", ".join(f"'{f}'" for f in FOLDABLE_PARTS))
        named = [f for f in KEY_PARTS if getattr(self, f) is not None]
        if len(named) != 1:
            raise ValueError("a key part names exactly one of " + ", ".join(f"'{f}'" for f in KEY_PARTS))
        return self


KEY_PARTS = ("identity", "header", "source_ip", "principal", "metadata", "method", "host", "route",
             "route_metadata", "context_extension", "plan", "descriptor")
Key = Annotated[list[KeyPart], Field(min_length=1, max_length=8)]
OnMissingKey = Literal["skip", "shared"]




class PlanSpec(_Strict):
    """Where a request's plan comes from (the same rule shapes as ``identity``; the first
    rule that yields a value wins), and the plan of every other request."""

    from_: list[IdentityRule] = Field(
        alias="from", min_length=1,
        description="Rules naming the plan; the first that yields a value wins.",
    )
    default: Name = Field(description="The plan of a request no rule names, or names a plan "
                          "the policy does not know.")

    @field_validator("from_")
    @classmethod
    def _names_a_plan(cls, rules: list[IdentityRule]) -> list[IdentityRule]:
        for rule in rules:
            if rule.source_ip or rule.principal:
                which = "source_ip" if rule.source_ip else "principal"
                raise ValueError(f"'{which}: true' cannot name a plan; use 'metadata' (a verified "
                                 "claim) or a header set by an authenticating filter")
        return rules


class RequestRatePlan(_Strict):
    """A ``request_rate`` limiter's numbers for one plan; unset numbers are the limiter's."""

    rate: Rate | None = None
    burst: Tokens | None = None
    cost: Tokens | None = None

    @model_validator(mode="after")
    def _some(self) -> RequestRatePlan:
        if self.rate is None and self.burst is None and self.cost is None:
            raise ValueError("a request_rate plan sets at least one of 'rate', 'burst', 'cost'")
        if self.cost is not None and self.burst is not None and self.cost > self.burst:
            raise ValueError(cost_message(self.cost, self.burst))
        if self.rate is not None and self.burst is not None:
            refill = refill_problem(self.rate, self.burst)
            if refill is not None:
                raise ValueError(refill)
        return self


class ConcurrentRequestsPlan(_Strict):
    """A ``concurrent_requests`` (or ``quota``) limiter's number for one plan."""

    limit: Count


#: the numbers a plan entry (and a live override) of each per-customer limiter kind sets.
PLAN_NUMBERS: dict[str, tuple[str, ...]] = {"request_rate": ("rate", "burst", "cost"),
                                            "concurrent_requests": ("limit",),
                                            "quota": ("limit",)}


def not_fields(names: list[str], kind: str) -> str:
    """``limit is not a request_rate field (request_rate: rate, burst, cost)``."""
    fields = f"{kind}: {', '.join(PLAN_NUMBERS[kind])}"
    if len(names) == 1:
        return f"{names[0]} is not a {kind} field ({fields})"
    return f"{', '.join(names)} are not {kind} fields ({fields})"


QuotaPlan = ConcurrentRequestsPlan


def cost_message(cost: float, burst: float) -> str:
    return f"cost ({cost:g}) is larger than burst ({burst:g}): no request could ever pass"


def refill_problem(rate: float, burst: float) -> str | None:
    """Why a bucket of ``burst`` tokens refilled at ``rate`` per second is refused (it would
    take longer than :data:`MAX_REFILL` to refill), or None."""
    if burst <= MAX_REFILL * rate:
        return None
    return (f"burst ({burst:g}) / rate ({rate:g}/s): the bucket would take {burst / rate:.3g} s "
            f"to refill, more than {MAX_REFILL / 86400:g} days ({MAX_REFILL:g} s): raise the "
            "rate or lower the burst")


def bucket_problem(rate: float, burst: float, cost: float) -> str | None:
    """Why a token bucket's numbers cannot work together (``cost > burst``, or a refill
    longer than :data:`MAX_REFILL`), or None: the one check for a limiter's own numbers, a
    plan's and an override's (filled in from the plan)."""
    if cost > burst:
        return cost_message(cost, burst)
    return refill_problem(rate, burst)


def _fleet_takes_none(what: str) -> Callable[[Any], Any]:
    """The validator of a per-customer field on a fleet-wide limiter: refused when set."""
    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"{what} per customer; this limiter protects the whole fleet and "
                             "takes none (only request_rate, concurrent_requests and quota do)")
        return value
    return check


NoPlans = Annotated[
    None, BeforeValidator(_fleet_takes_none("plans are")),
    Field(description="Not allowed: fleet-wide limiters have no per-customer plans."),
]
NoKey = Annotated[
    None, BeforeValidator(_fleet_takes_none("a key is")),
    Field(description="Not allowed: fleet-wide limiters count the whole fleet."),
]


class TestModeSpec(_Strict):
    """How to recognise test-mode traffic (always the ``test`` tier, shed first)."""

    __test__ = False  # not a pytest test class

    key_prefix: str | None = Field(
        None, description="Identities (header, metadata or principal rules) starting with this are test mode."
    )
    header: str | None = Field(None, description="A request header that is 'true' in test mode.")
    metadata: TestModeMetadata | None = Field(
        None, description="A filter-metadata value meaning test mode, e.g. "
        "{namespace: envoy.filters.http.jwt_authn, path: [payload, livemode], equals: false}."
    )


class Match(_Strict):
    methods: Methods | None = None
    path_prefix: str | None = None
    hosts: list[str] | None = None
    headers: dict[str, str] | None = Field(
        None, description="Header name to exact value; all must match."
    )


class ClassificationRule(_Strict):
    match: Match
    tier: TierName


class Classification(_Strict):
    route_metadata: RouteMetadataRef | None = Field(
        None, description="Where the route's metadata names its tier (default: namespace "
        "'extauthz', path [tier])."
    )
    route_metadata_namespace: str | None = Field(
        None, min_length=1, description="Short form of route_metadata: {namespace: NS, path: [tier]}."
    )
    context_extension_key: str = Field("tier", description="context_extensions key naming the tier.")
    descriptor_key: DescriptorKey = Field(
        "tier", description="The rate limit descriptor entry (ShouldRateLimit) whose value names "
        "the descriptor's tier: a route's generic_key or route metadata action (docs/migrating.md).")
    rules: list[ClassificationRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_route_metadata(self) -> Classification:
        if self.route_metadata is not None and self.route_metadata_namespace is not None:
            raise ValueError("set 'route_metadata' or its short form 'route_metadata_namespace', "
                             "not both")
        return self


class AppliesTo(_Strict):
    tiers: list[TierName] | None = None
    methods: Methods | None = None
    path_prefix: str | None = None
    hosts: list[str] | None = None


class _LimiterBase(_Strict):
    name: Name
    mode: ModeName = "enforce"
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    failure_mode: Literal["open", "closed"] = "open"


class _KeyedBase(_LimiterBase):
    key: Key | None = Field(
        None, description="What the limiter counts per: the values of all parts, in order "
        "(default: [{identity: true}]).")
    on_missing_key: OnMissingKey = Field(
        "skip", description="A request for which a key part yields nothing: 'skip' (the "
        "limiter does not apply; counted) or 'shared' (one bucket for all such requests).")
    match: DescriptorMatch | None = Field(
        None, description="Count rate limit descriptors (Envoy's ratelimit filter, "
        "ShouldRateLimit) instead of checked requests: the domain and entries matched; the key "
        "defaults to every entry's value.")
    replaces: list[Name] | None = Field(
        None, min_length=1, description="With 'match': limiters with 'match' this one switches "
        "off for the request, when both match its descriptors.")
    detailed_metric: bool = Field(
        False, description="With 'match': the limiter's decisions are counted per descriptor "
        "value too (a bounded label: the first values seen, then 'other').")

    @model_validator(mode="after")
    def _descriptor_fields(self) -> _KeyedBase:
        if self.match is None:
            extra = [f for f in ("replaces", "detailed_metric") if f in self.model_fields_set]
            if extra:
                verb = "applies" if len(extra) == 1 else "apply"
                raise ValueError(f"{' and '.join(extra)} only {verb} with 'match'")
            if any(p.descriptor is not None for p in self.key or ()):
                raise ValueError("a 'descriptor' key part needs 'match' (only a rate limit "
                                 "descriptor has entries)")
            return self
        known = [e.key for e in self.match.descriptor]
        for part in self.key or ():
            if part.descriptor is None:
                raise ValueError("a limiter with 'match' counts per descriptor entries: its key "
                                 "parts are 'descriptor' (a ShouldRateLimit request has no headers "
                                 "or route)")
            if part.descriptor not in known:
                raise ValueError(f"key part 'descriptor: {part.descriptor}' is not an entry of "
                                 f"'match' ({', '.join(known)})")
        if self.applies_to != AppliesTo():
            raise ValueError("'applies_to' does not apply with 'match' (the descriptor decides)")
        if self.on_missing_key != "skip":
            raise ValueError("'on_missing_key' does not apply with 'match' (every entry is there)")
        if self.name in (self.replaces or ()):
            raise ValueError(f"'{self.name}' replaces itself")
        return self


# -- batched grants (consistency: batched; extauthz.limiters.grants) -----------------------

#: ``sync_interval`` bounds: unspent grants go back (and idle keys are forgotten) within it.
MIN_SYNC_INTERVAL = 0.01
MAX_SYNC_INTERVAL = 10.0
#: fleet slots one grant may take: each is a member of the fleet's sorted set that its replica
#: renews every sync, so a grant costs Redis O(batch) (a 1% default of a 100M capacity was
#: 800,000 members per renewal: 30 ms script calls)
MAX_FLEET_BATCH = 1000
#: the default fleet batch's cap (1% of the non-critical limit, at least 1, at most this)
DEFAULT_FLEET_BATCH_MAX = 100
DEFAULT_SYNC_INTERVAL = 0.1


class _BatchedGrants(_Strict):
    """``consistency``, ``batch`` and ``sync_interval``: the fields of a limiter that may
    take its budget from the store in batched grants (docs/limiters.md)."""

    consistency: Literal["exact", "batched"] = Field(
        "exact", description="exact: every request asks the store; batched: a replica takes "
        "grants of 'batch' from the store and spends them locally (docs/limiters.md).")
    batch: Annotated[float, Field(ge=1, le=MAX_TOKENS)] | None = Field(
        None, description="batched: how much one store call takes (at least 1; a quota: whole "
        "requests); default: request_rate, what one sync_interval refills, at least 1 and at "
        "least the cost; quota, 1% of the limit, at least the cost; fleet_usage (slots), 1% of "
        "the non-critical limit, at least 1.")
    sync_interval: Annotated[Duration, Field(ge=MIN_SYNC_INTERVAL, le=MAX_SYNC_INTERVAL)] = Field(
        DEFAULT_SYNC_INTERVAL, description="batched: unspent grant goes back to the store within it, and a "
        f"replica that held none of a key's grant for that long forgets it (default "
        f"{DEFAULT_SYNC_INTERVAL * 1000:g}ms; {MIN_SYNC_INTERVAL * 1000:g}ms to {MAX_SYNC_INTERVAL:g}s).")

    @model_validator(mode="after")
    def _batched_only(self) -> _BatchedGrants:
        if self.consistency == "exact":
            extra = [name for name in ("batch", "sync_interval") if name in self.model_fields_set]
            if extra:
                verb = "applies" if len(extra) == 1 else "apply"
                raise ValueError(f"{' and '.join(extra)} only {verb} to consistency: batched")
        return self


#: the key parts Envoy's quota filter can build a bucket id from (enforce: envoy)
ENVOY_KEY_PARTS = ("header", "source_ip", "method")


def envoy_problem(spec: RequestRateSpec) -> str | None:
    """Why ``enforce: envoy`` cannot serve this limiter (docs/rlqs.md), or None."""
    why = "enforce: envoy: "
    for part in spec.key or [KeyPart(identity=True)]:
        named = next(f for f in KEY_PARTS if getattr(part, f) is not None)
        if named not in ENVOY_KEY_PARTS:
            hint = (" (the identity is read and hashed by this server; copy what Envoy should key on "
                    "to a header)" if named in ("identity", "metadata", "principal", "plan") else "")
            return (f"{why}Envoy cannot build the key part '{named}'{hint}; it builds "
                    + ", ".join(f"'{f}'" for f in ENVOY_KEY_PARTS))
        if part.strip_prefix is not None or part.case is not None:
            return f"{why}Envoy takes a header's whole value: no 'strip_prefix' or 'case'"
    if spec.on_missing_key != "skip":
        return f"{why}on_missing_key: shared is not served in Envoy (a request without the key is not limited there)"
    if spec.plans:
        return f"{why}a bucket id carries no plan: no 'plans'"
    if spec.consistency != "exact":
        return f"{why}Envoy holds the tokens: no 'consistency: batched'"
    if spec.mode != "enforce":
        return f"{why}Envoy enforces what it is given: mode '{spec.mode}' is not served there"
    if spec.applies_to.tiers is not None or spec.applies_to.hosts is not None:
        return f"{why}applies_to takes 'path_prefix' and 'methods' only (the tier is this server's)"
    return None


def shed_envoy_problem(spec: WorkerUtilizationSpec) -> str | None:
    """Why ``envoy_deny_all`` cannot push this shedder's tiers to Envoy (docs/rlqs.md), or
    None. The policy's tier sources are checked by the loader (they are other sections)."""
    why = "envoy_deny_all: "
    if spec.match is not None:
        return f"{why}a shedder of descriptors ('match') has no quota filter bucket to deny"
    if spec.mode != "enforce":
        return f"{why}Envoy enforces what it is given: mode '{spec.mode}' is not pushed there"
    applies = spec.applies_to
    if applies.hosts is not None or applies.path_prefix is not None or applies.methods is not None:
        return (f"{why}applies_to takes 'tiers' only (the quota filter's first matcher decides a "
                "request's tier bucket: a scope beside it would move requests to another tier)")
    return None


class RequestRateSpec(_BatchedGrants, _KeyedBase):
    """Token bucket per user: ``rate`` tokens per second up to ``burst``."""

    type: Literal["request_rate"]
    rate: Rate
    burst: Tokens
    cost: Tokens = 1.0
    plans: dict[Name, RequestRatePlan] | None = Field(
        None, description="Numbers per plan (rate, burst, cost); a plan not listed uses the "
        "limiter's own.")
    enforce: Literal["server", "envoy"] = Field(
        "server", description="server: every check asks this server; envoy: Envoy's rate limit "
        "quota filter holds the tokens and this server divides rate and burst across Envoys "
        "(docs/rlqs.md; keys on 'header', 'source_ip', 'method' only; the check skips it).")

    @model_validator(mode="after")
    def _envoy_can_serve(self) -> RequestRateSpec:
        if self.enforce == "envoy" and (problem := envoy_problem(self)) is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _cost_fits(self) -> RequestRateSpec:
        problem = bucket_problem(self.rate, self.burst, self.cost)
        if problem is not None:
            raise ValueError(problem)
        for name, plan in (self.plans or {}).items():
            problem = bucket_problem(self.rate if plan.rate is None else plan.rate,
                                     self.burst if plan.burst is None else plan.burst,
                                     self.cost if plan.cost is None else plan.cost)
            if problem is not None:
                raise ValueError(f"plan '{name}': {problem}")
        return self


class ConcurrentRequestsSpec(_KeyedBase):
    """At most ``limit`` requests in flight per user."""

    type: Literal["concurrent_requests"]
    limit: Count
    lease_ttl: Annotated[Duration, Field(ge=1)] = 60.0
    plans: dict[Name, ConcurrentRequestsPlan] | None = Field(
        None, description="The limit per plan; a plan not listed uses the limiter's own.")


QuotaPeriod = Literal["second", "minute", "hour", "day", "week", "month", "year"]


class QuotaSpec(_BatchedGrants, _KeyedBase):
    """At most ``limit`` requests per calendar ``period`` (UTC; weeks start on Monday)."""

    type: Literal["quota"]
    limit: Count
    period: QuotaPeriod
    cost: Count = 1
    plans: dict[Name, QuotaPlan] | None = Field(
        None, description="The limit per plan; a plan not listed uses the limiter's own.")

    @model_validator(mode="after")
    def _cost_fits(self) -> QuotaSpec:
        for name, limit in [("", self.limit), *((n, p.limit) for n, p in (self.plans or {}).items())]:
            if self.cost > limit:
                where = f"plan '{name}': " if name else ""
                raise ValueError(f"{where}cost ({self.cost}) is larger than limit ({limit}): "
                                 "no request could ever pass")
        return self

    @model_validator(mode="after")
    def _whole_batch(self) -> QuotaSpec:
        if self.batch is not None and self.batch != int(self.batch):
            raise ValueError(f"batch ({self.batch:g}) of a quota is whole requests")
        return self


class FleetUsageSpec(_BatchedGrants, _LimiterBase):
    """Fleet-wide in-flight cap keeping ``reserved_for_critical`` for critical traffic."""

    type: Literal["fleet_usage"]
    capacity: Count
    reserved_for_critical: Annotated[float, Field(ge=0, lt=1)] = 0.2
    lease_ttl: Annotated[Duration, Field(ge=1)] = 60.0
    plans: NoPlans = None
    key: NoKey = None
    match: DescriptorMatch | None = Field(
        None, description="Hold slots for rate limit descriptors (Envoy's ratelimit filter, "
        "ShouldRateLimit) instead of checked requests: the domain and entries matched; each "
        "descriptor's tier is its entry named by classification.descriptor_key (default 'tier'), "
        "else 'post'; the leases are released by Envoy's access log (docs/migrating.md).")

    @model_validator(mode="after")
    def _match_alone(self) -> FleetUsageSpec:
        if self.match is not None and self.applies_to != AppliesTo():
            raise ValueError("'applies_to' does not apply with 'match' (the descriptor decides)")
        return self

    @model_validator(mode="after")
    def _whole_slots(self) -> FleetUsageSpec:
        if self.batch is not None and self.batch != int(self.batch):
            raise ValueError(f"batch ({self.batch:g}) of fleet_usage is whole slots")
        if self.batch is not None and self.batch > MAX_FLEET_BATCH:
            raise ValueError(f"batch ({self.batch:g}) of fleet_usage is at most {MAX_FLEET_BATCH} slots "
                             "(each slot is one member of the fleet's sorted set, renewed every sync)")
        return self


class Signal(_Strict):
    source: Literal["inflight", "redis", "envoy_admin"]
    capacity: Count | None = Field(
        None, description="Upstream workers (inflight, envoy_admin)."
    )
    key: str | None = Field(None, description="Store key the services publish into (redis).")
    url: str | None = Field(None, description="Envoy admin base URL (envoy_admin).")
    cluster: str | None = Field(None, description="Envoy upstream cluster name (envoy_admin).")

    @model_validator(mode="after")
    def _fields_for_source(self) -> Signal:
        if self.source in ("inflight", "envoy_admin") and self.capacity is None:
            raise ValueError(f"signal source '{self.source}' needs 'capacity'")
        if self.source == "envoy_admin" and (self.url is None or self.cluster is None):
            raise ValueError("signal source 'envoy_admin' needs 'url' and 'cluster'")
        return self


class WorkerUtilizationSpec(_LimiterBase):
    """Sheds test, then GET, then POST traffic when utilization stays bad; never critical."""

    type: Literal["worker_utilization"]
    signal: Signal
    sample_interval: Annotated[Duration, Field(gt=0)] = 8.0
    good_below: Annotated[float, Field(gt=0, lt=1)] = 0.7
    bad_above: Annotated[float, Field(gt=0, lt=1)] = 0.8
    delay_before_shedding: Duration = 28.0
    time_to_shed_all: Annotated[Duration, Field(gt=0)] = 120.0
    lease_ttl: Annotated[Duration, Field(ge=1)] = 60.0
    plans: NoPlans = None
    key: NoKey = None
    match: DescriptorMatch | None = Field(
        None, description="Shed rate limit descriptors (Envoy's ratelimit filter, ShouldRateLimit) "
        "instead of checked requests: the domain and entries matched; each descriptor's tier is "
        "its entry named by classification.descriptor_key (default 'tier'), else 'post'.")
    envoy_deny_all: bool = Field(
        False, description="Also push DENY_ALL to Envoy's rate limit quota filter (envoy-config "
        "--rlqs) for each tier this shedder sheds whole (drop probability 1; never critical), at "
        "the quota stream's report cadence, and take it back when it sheds less: Envoy refuses "
        "that traffic without a check. The ramp stays in the check. Envoy must tell the tiers "
        "apart: test_mode.header, classification rules on methods, path_prefix and headers, the "
        "method default (docs/rlqs.md).")

    @model_validator(mode="after")
    def _envoy_deny_all(self) -> WorkerUtilizationSpec:
        if self.envoy_deny_all and (problem := shed_envoy_problem(self)) is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _dead_zone(self) -> WorkerUtilizationSpec:
        if self.good_below > self.bad_above:
            raise ValueError(f"good_below ({self.good_below:g}) is above bad_above ({self.bad_above:g})")
        return self

    @model_validator(mode="after")
    def _match_alone(self) -> WorkerUtilizationSpec:
        if self.match is not None and self.applies_to != AppliesTo():
            raise ValueError("'applies_to' does not apply with 'match' (the descriptor decides)")
        return self


LimiterSpec = Annotated[
    RequestRateSpec | ConcurrentRequestsSpec | QuotaSpec | FleetUsageSpec | WorkerUtilizationSpec,
    Field(discriminator="type"),
]
LIMITER_TYPES = ("request_rate", "concurrent_requests", "quota", "fleet_usage", "worker_utilization")


class PolicyFile(_Strict):
    """One policy file. A directory of them is merged into one policy."""

    version: Literal[1]
    identity: list[IdentityRule] | None = None
    plan: PlanSpec | None = Field(None, description="Where a request's plan comes from; "
                                  "limiters' 'plans' give the numbers per plan.")
    test_mode: TestModeSpec | None = None
    classification: Classification | None = None
    limiters: list[LimiterSpec] = Field(default_factory=list)
    unlimited: list[UnlimitedSpec] = Field(
        default_factory=list, description="Rate limit descriptors no limit applies to "
        "(envoyproxy/ratelimit's 'unlimited: true').")
    ratelimit_headers: RateLimitHeadersSpec | None = Field(
        None, description="The rate limit headers of ShouldRateLimit's answers (default: style ietf).")
