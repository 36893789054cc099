"""The compiled policy: frozen data the request path only reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..core.context import host_name
from ..core.tiers import Tier
from .descriptors import DescriptorTable, ResponseHeaders, Target
from .schema import (
    AppliesTo,
    Classification,
    DescriptorMatch,
    IdentityRule,
    KeyPart,
    LimiterSpec,
    Match,
    PolicyFile,
    RateLimitHeaderNames,
    RateLimitHeadersSpec,
    UnlimitedSpec,
)


@dataclass(frozen=True, slots=True)
class Matcher:
    """Method, path prefix, host and header conditions; an unset condition matches all."""

    methods: frozenset[str] | None = None
    path_prefix: str | None = None
    hosts: frozenset[str] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    tiers: frozenset[Tier] | None = None
    #: a limiter with ``match``: its name (it applies to the descriptors that reach it and
    #: to nothing else); None: it applies to checked requests, never to a descriptor.
    descriptor: str | None = None

    def matches(self, method: str, path: str, host: str, headers: Mapping[str, str],
                tier: Tier | None = None, target: str | None = None) -> bool:
        if self.descriptor != target:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.hosts is not None and host_name(host) not in self.hosts:
            return False
        for name, value in self.headers:
            if headers.get(name) != value:
                return False
        return not (self.tiers is not None and tier is not None and tier not in self.tiers)

    @property
    def header_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.headers)


def compile_match(m: Match | AppliesTo, descriptor: str | None = None) -> Matcher:
    """A matcher of ``m``; ``descriptor``: the name of the limiter with ``match`` it belongs to."""
    headers = getattr(m, "headers", None) or {}
    tiers = getattr(m, "tiers", None)
    return Matcher(
        methods=frozenset(m.methods) if m.methods else None,
        path_prefix=m.path_prefix or None,
        hosts=frozenset(host_name(h) for h in m.hosts) if m.hosts else None,
        headers=tuple((k.lower(), v) for k, v in sorted(headers.items())),
        tiers=frozenset(Tier(t) for t in tiers) if tiers else None,
        descriptor=descriptor,
    )


MetadataPath = tuple[str, ...]
#: a path in route metadata: keys and list indexes (``classify.path_value`` follows it).
RoutePath = tuple[str | int, ...]
#: (namespace, path) of a value in the route's filter metadata.
RouteRef = tuple[str, RoutePath]
#: where the route names its tier when the policy does not say.
DEFAULT_ROUTE_TIER: RouteRef = ("extauthz", ("tier",))


@dataclass(frozen=True, slots=True)
class IdentitySource:
    header: str | None
    strip_prefix: str | None
    source_ip: bool
    #: (namespace, path) in the request's filter metadata.
    metadata: tuple[str, MetadataPath] | None = None
    principal: bool = False

    @property
    def label(self) -> str:
        if self.source_ip:
            return "source_ip"
        if self.principal:
            return "principal"
        if self.metadata is not None:
            return f"metadata:{self.metadata[0]}:{'.'.join(self.metadata[1])}"
        return f"header:{self.header}"


@dataclass(frozen=True, slots=True)
class KeySource:
    """One compiled key part (``schema.KeyPart``): ``kind`` is its field name."""

    kind: str
    #: header, source_ip, principal, metadata: the same extraction as an identity rule.
    source: IdentitySource | None = None
    #: context_extension: its name; descriptor: the entry's key.
    name: str = ""
    #: route, route_metadata: where in the route's metadata.
    route: RouteRef | None = None
    #: ``case: fold``: the value case-folded (the label, the hash's domain, stays the same).
    fold: bool = False

    @property
    def label(self) -> str:
        if self.source is not None:
            return self.source.label
        if self.name:
            return f"{self.kind}:{self.name}"
        if self.kind == "route_metadata" and self.route is not None:
            return f"route_metadata:{self.route[0]}:{'.'.join(map(str, self.route[1]))}"
        return self.kind


@dataclass(frozen=True, slots=True)
class KeySpec:
    """A limiter's key: the parts' values, in order, hashed into one store-key identity."""

    parts: tuple[KeySource, ...]

    @property
    def label(self) -> str:
        """What the key is made of (``key:header:x-api-key+method``): the hash's domain."""
        return "key:" + "+".join(p.label for p in self.parts)


@dataclass(frozen=True, slots=True)
class MetadataTest:
    """Test mode when the value at (namespace, path) equals ``equals``."""

    namespace: str
    path: MetadataPath
    equals: str | int | float | bool


@dataclass(frozen=True, slots=True)
class Rule:
    matcher: Matcher
    tier: Tier


DEFAULT_IDENTITY = (IdentitySource(None, None, True),)


@dataclass(frozen=True, slots=True)
class Policy:
    version: str
    sources: tuple[str, ...]
    identity: tuple[IdentitySource, ...]
    test_key_prefix: str | None
    test_header: str | None
    #: where the route's metadata names the tier (``classification.route_metadata``).
    route_metadata: RouteRef
    context_extension_key: str
    rules: tuple[Rule, ...]
    limiters: tuple[LimiterSpec, ...]
    test_metadata: MetadataTest | None = None
    #: where a request's plan comes from (empty: no ``plan`` section, every request has
    #: the plan ``""``, i.e. every limiter's own numbers).
    plan_sources: tuple[IdentitySource, ...] = ()
    plan_default: str = ""
    #: the plans the policy names (the default and every limiter's ``plans`` keys).
    plan_names: frozenset[str] = frozenset()
    #: the distinct keys of keyed limiters (a key other than ``[{identity: true}]``), and
    #: each keyed limiter's index into them (``RequestContext.keys`` holds their values).
    keys: tuple[KeySpec, ...] = ()
    key_index: Mapping[str, int] = field(default_factory=dict)
    #: the limiters with ``match`` and the ``unlimited`` entries, by domain and descriptor
    #: (what ``ShouldRateLimit`` looks up; empty: the policy counts no descriptors)
    descriptors: DescriptorTable = field(default_factory=DescriptorTable)
    #: the descriptor entry whose value names a descriptor's tier (``classification.descriptor_key``)
    descriptor_tier_key: str = "tier"
    #: the rate limit headers of ShouldRateLimit's answers (``ratelimit_headers``)
    ratelimit_headers: ResponseHeaders = field(default_factory=ResponseHeaders)
    #: the longest ``lease_ttl`` of the policy's limiters (0 without lease limiters): no lease
    #: the policy takes outlives it. Computed once: the request-id index reads it per check.
    longest_lease_ttl: float = field(init=False)
    #: the request headers the engine reads; the edge copies only these. Computed once, when
    #: the policy is compiled (a walk over every rule: 23 ms at 12,000 rules, which a reload's
    #: swap on the event loop must not pay; a pickled policy carries it).
    needed_headers: frozenset[str] = field(init=False)
    #: each limiter's index in ``limiters`` by name (:meth:`limiter`: ShouldRateLimit looks one
    #: up per descriptor). Names and ints only: a pickled policy's limiters travel once.
    limiter_index: Mapping[str, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "limiter_index", {spec.name: i for i, spec in enumerate(self.limiters)})
        object.__setattr__(self, "longest_lease_ttl", max(
            (float(getattr(spec, "lease_ttl", 0.0)) for spec in self.limiters), default=0.0))
        names = {s.header for s in (*self.identity, *self.plan_sources, *self._key_sources) if s.header}
        if self.test_header:
            names.add(self.test_header)
        for rule in self.rules:
            names |= rule.matcher.header_names
        object.__setattr__(self, "needed_headers", frozenset(n.lower() for n in names))

    @property
    def route_metadata_namespace(self) -> str:
        """The route metadata namespace the classifier reads (the tier's)."""
        return self.route_metadata[0]

    @property
    def needed_route_metadata(self) -> tuple[RouteRef, ...]:
        """The route-metadata values the engine reads, the tier's first; the edge extracts
        only these."""
        refs = [self.route_metadata]
        for spec in self.keys:
            for part in spec.parts:
                if part.route is not None and part.route not in refs:
                    refs.append(part.route)
        return tuple(refs)

    @property
    def _key_sources(self) -> tuple[IdentitySource, ...]:
        return tuple(p.source for spec in self.keys for p in spec.parts if p.source is not None)

    @property
    def needed_metadata(self) -> Mapping[str, tuple[MetadataPath, ...]]:
        """Filter-metadata namespace -> the paths the engine reads; the edge extracts only these."""
        wanted: dict[str, list[MetadataPath]] = {}
        refs = [s.metadata for s in (*self.identity, *self.plan_sources, *self._key_sources)
                if s.metadata is not None]
        if self.test_metadata is not None:
            refs.append((self.test_metadata.namespace, self.test_metadata.path))
        for namespace, path in refs:
            paths = wanted.setdefault(namespace, [])
            if path not in paths:
                paths.append(path)
        return {ns: tuple(paths) for ns, paths in wanted.items()}

    @property
    def identity_labels(self) -> tuple[str, ...]:
        """The labels of the identity rules (``header:x-api-key``, ``source_ip``), in order:
        the sources an identity hash can be made for."""
        return tuple(s.label for s in self.identity)

    def limiter(self, name: str) -> LimiterSpec | None:
        at = self.limiter_index.get(name)
        return None if at is None else self.limiters[at]


def compile_sources(rules: Sequence[IdentityRule]) -> tuple[IdentitySource, ...]:
    """Identity (and plan) rules as the classifier reads them."""
    return tuple(
        IdentitySource(r.header.lower() if r.header else None, r.strip_prefix, r.source_ip,
                       (r.metadata.namespace, tuple(r.metadata.path)) if r.metadata else None,
                       r.principal)
        for r in rules
    )


def compile_key(parts: Sequence[KeyPart], route_namespace: str) -> KeySpec:
    out: list[KeySource] = []
    for part in parts:
        fold = part.case == "fold"
        if part.header is not None or part.source_ip or part.principal or part.metadata is not None:
            out.append(KeySource("source", compile_sources([IdentityRule(
                header=part.header, strip_prefix=part.strip_prefix, source_ip=bool(part.source_ip),
                metadata=part.metadata, principal=bool(part.principal))])[0], fold=fold))
        elif part.context_extension is not None:
            out.append(KeySource("context_extension", name=part.context_extension, fold=fold))
        elif part.descriptor is not None:
            out.append(KeySource("descriptor", name=part.descriptor, fold=fold))
        elif part.route:
            out.append(KeySource("route", route=(route_namespace, ("route",)), fold=fold))
        elif part.route_metadata is not None:
            out.append(KeySource("route_metadata", route=(part.route_metadata.namespace,
                                                          tuple(part.route_metadata.path)), fold=fold))
        else:
            out.append(KeySource(next(f for f in ("identity", "method", "host", "plan")
                                      if getattr(part, f))))
    return KeySpec(tuple(out))


def compile_keys(limiters: Sequence[LimiterSpec], route_namespace: str
                 ) -> tuple[tuple[KeySpec, ...], dict[str, int]]:
    """The distinct keys of the keyed limiters and each one's index; a limiter without
    ``key`` or with ``[{identity: true}]`` counts per identity (no entry)."""
    specs: list[KeySpec] = []
    index: dict[str, int] = {}
    for spec in limiters:
        parts = spec.key
        match = spec.match
        if spec.type in ("fleet_usage", "worker_utilization"):
            continue  # fleet-wide: no key (with 'match' too: it sheds every descriptor it matches)
        if not parts and match is not None:  # the counter per descriptor value
            parts = [KeyPart(descriptor=e.key) for e in match.descriptor]
        if not parts:
            continue
        key = compile_key(parts, route_namespace)
        if key.parts == (KeySource("identity"),):
            continue
        if key not in specs:
            specs.append(key)
        index[spec.name] = specs.index(key)
    return tuple(specs), index


def descriptor_targets(limiters: Sequence[LimiterSpec], unlimited: Sequence[UnlimitedSpec]
                       ) -> list[tuple[DescriptorMatch, Target]]:
    """What the descriptor table files: each limiter with ``match`` and each ``unlimited``
    entry, in policy order."""
    out: list[tuple[DescriptorMatch, Target]] = []
    for spec in limiters:
        match = spec.match
        if match is not None:
            out.append((match, Target(spec.name, replaces=frozenset(getattr(spec, "replaces", None) or ()))))
    for entry in unlimited:
        out.append((entry.match, Target(entry.name or "", True, frozenset(entry.replaces or ()))))
    return out


def compile_descriptors(targets: Sequence[tuple[DescriptorMatch, Target]]) -> DescriptorTable:
    """The table of ``targets`` (the loader has refused duplicates; a later one is dropped)."""
    table = DescriptorTable()
    for match, target in targets:
        table.add(match.domain, [(e.key, e.value) for e in match.descriptor], target)
    return table


def route_tier_ref(classification: Classification | None) -> RouteRef:
    """Where the tier is read: ``route_metadata``, or its short form
    ``route_metadata_namespace: NS`` (``{namespace: NS, path: [tier]}``), or the default."""
    if classification is None:
        return DEFAULT_ROUTE_TIER
    if classification.route_metadata is not None:
        ref = classification.route_metadata
        return ref.namespace, tuple(ref.path)
    if classification.route_metadata_namespace is not None:
        return classification.route_metadata_namespace, DEFAULT_ROUTE_TIER[1]
    return DEFAULT_ROUTE_TIER


def response_headers(spec: RateLimitHeadersSpec | None) -> ResponseHeaders:
    """The policy's ``ratelimit_headers``, compiled (names lower case, as Envoy sends them)."""
    if spec is None:
        return ResponseHeaders()
    names = spec.names or RateLimitHeaderNames()
    return ResponseHeaders(spec.style, names.limit.lower(), names.remaining.lower(), names.reset.lower())


def compile_policy(files: Sequence[PolicyFile], *, version: str,
                   sources: tuple[str, ...] = ()) -> Policy:
    identity = next((f.identity for f in files if f.identity is not None), None)
    plan = next((f.plan for f in files if f.plan is not None), None)
    test_mode = next((f.test_mode for f in files if f.test_mode is not None), None)
    classification = next((f.classification for f in files if f.classification is not None), None)
    headers = next((f.ratelimit_headers for f in files if f.ratelimit_headers is not None), None)
    limiters = tuple(spec for f in files for spec in f.limiters)
    route_metadata = route_tier_ref(classification)
    keys, key_index = compile_keys(limiters, route_metadata[0])
    return Policy(
        version=version,
        sources=sources,
        identity=compile_sources(identity) if identity else DEFAULT_IDENTITY,
        test_key_prefix=test_mode.key_prefix if test_mode else None,
        test_header=test_mode.header.lower() if test_mode and test_mode.header else None,
        route_metadata=route_metadata,
        context_extension_key=classification.context_extension_key if classification else "tier",
        descriptor_tier_key=classification.descriptor_key if classification else "tier",
        ratelimit_headers=response_headers(headers),
        rules=tuple(
            Rule(compile_match(r.match), Tier(r.tier)) for r in classification.rules
        ) if classification else (),
        limiters=limiters,
        test_metadata=MetadataTest(test_mode.metadata.namespace, tuple(test_mode.metadata.path),
                                   test_mode.metadata.equals)
        if test_mode is not None and test_mode.metadata is not None else None,
        plan_sources=compile_sources(plan.from_) if plan else (),
        plan_default=plan.default if plan else "",
        plan_names=frozenset(
            [plan.default, *(name for spec in limiters for name in (spec.plans or {}))]
        ) if plan else frozenset(),
        keys=keys,
        key_index=key_index,
        descriptors=compile_descriptors(descriptor_targets(
            limiters, [entry for f in files for entry in f.unlimited])),
    )
