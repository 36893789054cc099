"""Rate limit descriptors (Envoy's ratelimit filter, ``ShouldRateLimit``) -> the limiter
that counts each: the most specific match, as envoyproxy/ratelimit decides.

The limiters with ``match`` and the policy's ``unlimited`` entries are compiled once into
one tree per domain (:class:`DescriptorTable`), the shape envoyproxy/ratelimit builds from
its nested config: a node per entry, reached by ``key`` plus ``value`` (or a value prefix,
``value: "abc*"``) or by ``key`` alone (the default for the values no sibling names).
:meth:`DescriptorTable.lookup` walks a descriptor's entries greedily, as the peer does: at
each entry the node for the exact value, else the first prefix that fits, else the key's
default; a descriptor whose entries run past the tree, or that ends on a node without a
target, gets no limit (no backtracking to a less specific default). :func:`replaced` then
applies ``replaces`` across the request's descriptors (unlimited targets kept: the door
answers them OK, uncounted).

The counter is per descriptor value: a limiter's key defaults to every entry's value (the
limiter's label, ``key:descriptor:a+descriptor:b``, keeps domains and shapes apart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: a descriptor as the server reads it: its entries' (key, value), in order
Entries = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Target:
    """What a descriptor matched: a limiter (by name) or an unlimited entry."""

    #: the limiter's name; an unlimited entry's name or "" (then ``unlimited``)
    name: str
    unlimited: bool = False
    replaces: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Node:
    #: "key" (the default) and "key\0value" (an exact value) -> the next level
    children: dict[str, _Node] = field(default_factory=dict)
    #: value prefixes ("key\0abc" for "abc*"), in the order the policy gives them
    prefixes: list[tuple[str, str]] = field(default_factory=list)
    target: Target | None = None


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    """The rate limit headers of ``ShouldRateLimit``'s answers (the policy's
    ``ratelimit_headers``): ``style`` "ietf" (``RateLimit-Policy``/``RateLimit``, and
    ``Retry-After`` when over), "counts" (envoyproxy/ratelimit's ``LIMIT_RESPONSE_HEADERS_ENABLED``:
    the limit, what is left, the seconds until the window ends, under the three names) or
    "none"."""

    style: str = "ietf"
    limit: str = "ratelimit-limit"
    remaining: str = "ratelimit-remaining"
    reset: str = "ratelimit-reset"


def _step(key: str, value: str | None) -> str:
    return key if value is None else f"{key}\0{value}"


class DescriptorTable:
    """The compiled descriptor tree of every domain; read only once built."""

    __slots__ = ("_domains",)

    def __init__(self) -> None:
        self._domains: dict[str, _Node] = {}

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(self._domains)

    def __bool__(self) -> bool:
        return bool(self._domains)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DescriptorTable) and self._domains == other._domains

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, _Node]:
        return self._domains

    def __setstate__(self, state: dict[str, _Node]) -> None:
        self._domains = state

    def add(self, domain: str, entries: Sequence[tuple[str, str | None]], target: Target) -> Target | None:
        """File ``target`` at the node ``entries`` reach; the target already there (a
        duplicate descriptor: the caller refuses the policy), else None."""
        node = self._domains.setdefault(domain, _Node())
        for key, value in entries:
            step = _step(key, value)
            nxt = node.children.get(step)
            if nxt is None:
                nxt = node.children[step] = _Node()
                if value is not None and value.endswith("*"):
                    node.prefixes.append((f"{key}\0{value[:-1]}", step))
            node = nxt
        if node.target is not None:
            return node.target
        node.target = target
        return None

    def lookup(self, domain: str, entries: Entries) -> Target | None:
        """The target of one descriptor (envoyproxy/ratelimit's ``GetLimit``), or None."""
        node = self._domains.get(domain)
        if node is None or not entries:
            return None
        for key, value in entries:
            if "\0" in key:  # the separator of key and value: such a key names no node
                return None
            exact = f"{key}\0{value}"
            nxt = node.children.get(exact)
            if nxt is None:
                for prefix, step in node.prefixes:
                    if exact.startswith(prefix):
                        nxt = node.children[step]
                        break
            if nxt is None:
                nxt = node.children.get(key)
            if nxt is None:
                return None
            node = nxt
        return node.target

def replaced(found: list[Target | None]) -> list[Target | None]:
    """``found`` (each descriptor's :meth:`DescriptorTable.lookup`) with the limiters another
    matched target ``replaces`` dropped (None)."""
    names = {name for t in found if t is not None for name in t.replaces}
    if not names:
        return found
    return [None if t is not None and not t.unlimited and t.name in names else t for t in found]


def entries_of(pairs: Mapping[str, str] | Sequence[tuple[str, str]]) -> Entries:
    """A descriptor as (key, value) pairs (a test's or a command's dict, in order)."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple((str(k), str(v)) for k, v in items)
