"""``extauthz import ratelimit-config``: envoyproxy/ratelimit config files -> policy files
with the same decisions (docs/migrating.md).

Each descriptor of the peer's tree that carries a ``rate_limit`` becomes a ``quota``
limiter with ``match`` (the domain and the entries on the way down; ``requests_per_unit``
per ``unit``, ``shadow_mode`` as ``mode: shadow``, ``replaces``, ``detailed_metric``); an
``unlimited: true`` one, and a leaf with no limit (which the peer answers with no limit),
an entry of ``unlimited``. The peer's lookup is the policy's (most specific, greedy), so
the decisions are the same, except where docs/migrating.md says we differ (calendar weeks,
months and years; over-limit hits not counted). What cannot be converted is refused with
the file and line: an unknown key, a bad unit, a unit beside ``unlimited``, a limit of 0
requests, a duplicate descriptor or domain, a ``replaces`` naming its own limit, a ``*``
before a value's end, and the peer's keys in :data:`NOT_CONVERTED`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..policy.schema import MAX_COUNT, MAX_DESCRIPTOR_ENTRIES, MAX_DESCRIPTOR_KEY, MAX_DESCRIPTOR_VALUE

#: the peer's keys (src/config/config_impl.go validKeys)
VALID_KEYS = frozenset({"domain", "key", "value", "descriptors", "rate_limit", "unit", "requests_per_unit",
                        "unlimited", "shadow_mode", "name", "replaces", "detailed_metric", "quota_mode",
                        "value_to_metric", "share_threshold", "metadata"})
#: a descriptor's keys the peer knows that change its decisions or answers in ways a policy
#: cannot say: refused when set (``metadata``: at all; the flags: when true)
NOT_CONVERTED = {
    "share_threshold": "it shares one counter among the values a wildcard matches; here each value "
                       "has its own",
    "quota_mode": "the peer refuses on such a limit only when every quota-mode limit of the request is "
                  "over; here each limit refuses alone",
    "metadata": "the server does not add a limit's metadata to its answer",
}
UNITS = ("second", "minute", "hour", "day", "week", "month", "year")
#: units whose windows differ from the peer's (fixed 7, 30 and 365 days from the epoch)
CALENDAR_UNITS = ("week", "month", "year")
_NAME_OK = re.compile(r"[^a-z0-9_.-]+")


class ConvertError(ValueError):
    """What cannot be converted, with the file and line."""

    def __init__(self, file: str, line: int, message: str) -> None:
        super().__init__(f"{file}:{line}: {message}")


@dataclass
class Converted:
    """One file's policy document and what the reader should know about it."""

    source: str
    domain: str
    limiters: list[dict[str, Any]] = field(default_factory=list)
    unlimited: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"version": 1, "limiters": self.limiters}
        if self.unlimited:
            doc["unlimited"] = self.unlimited
        return doc

    def text(self) -> str:
        head = (f"# Converted from {self.source} (envoyproxy/ratelimit, domain '{self.domain}') by\n"
                "# extauthz import ratelimit-config; docs/migrating.md says where the decisions differ.\n")
        return head + yaml.safe_dump(self.document(), sort_keys=False)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _mapping(file: str, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise ConvertError(file, _line(node), f"{what} is a mapping")
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or not isinstance(key.value, str):
            raise ConvertError(file, _line(key), "a key is not a string")
        if key.value not in VALID_KEYS:
            raise ConvertError(file, _line(key), f"unknown key '{key.value}' (envoyproxy/ratelimit refuses it too)")
        if key.value in out:
            raise ConvertError(file, _line(key), f"duplicate key '{key.value}'")
        out[key.value] = (key, value)
    return out


def _scalar(file: str, node: yaml.Node, what: str) -> str:
    if not isinstance(node, yaml.ScalarNode):
        raise ConvertError(file, _line(node), f"{what} is a string")
    return str(node.value)


def _bool(file: str, node: yaml.Node, what: str) -> bool:
    value = yaml.safe_load(yaml.serialize(node))
    if not isinstance(value, bool):
        raise ConvertError(file, _line(node), f"{what} is true or false")
    return value


class _Names:
    """Limiter names: the peer's ``name`` where it gives one, else made from the domain and
    the entries; each a valid, unique policy name (the peer's names map to them)."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        #: a peer's name -> the limiters so named (the peer's names need not be unique)
        self.by_peer: dict[str, list[str]] = {}

    def make(self, wanted: str) -> str:
        base = _NAME_OK.sub("-", wanted.lower()).strip("-._") or "limit"
        if not base[0].isalnum():
            base = "l" + base
        name = base[:63]
        if name in self.used:
            digest = hashlib.sha256(wanted.encode()).hexdigest()[:8]
            name = f"{base[:54]}-{digest}"
            n = 2
            while name in self.used:
                name = f"{base[:50]}-{digest}-{n}"
                n += 1
        self.used.add(name)
        return name


def convert(files: Sequence[tuple[str, str]]) -> list[Converted]:
    """``(file name, text)`` pairs -> one :class:`Converted` per file. Raises
    :class:`ConvertError` at the first thing it cannot convert."""
    names = _Names()
    domains: dict[str, str] = {}
    out: list[Converted] = []
    pending_replaces: list[tuple[Converted, dict[str, Any], str, int]] = []
    for file, text in files:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise ConvertError(file, mark.line + 1 if mark is not None else 1, f"not YAML: {exc}") from None
        if root is None:
            raise ConvertError(file, 1, "empty file")
        top = _mapping(file, root, "a config file")
        if "domain" not in top:
            raise ConvertError(file, _line(root), "config file cannot have empty domain")
        domain = _scalar(file, top["domain"][1], "domain")
        if not domain:
            raise ConvertError(file, _line(top["domain"][1]), "config file cannot have empty domain")
        if len(domain) > MAX_DESCRIPTOR_KEY:
            raise ConvertError(file, _line(top["domain"][1]), f"a domain of {len(domain)} characters: at most "
                               f"{MAX_DESCRIPTOR_KEY} here")
        if domain in domains:
            raise ConvertError(file, _line(top["domain"][1]),
                               f"duplicate domain '{domain}' (first in {domains[domain]})")
        domains[domain] = file
        for key in top:
            if key not in ("domain", "descriptors"):
                raise ConvertError(file, _line(top[key][0]), f"'{key}' is not a top-level key")
        conv = Converted(file, domain)
        out.append(conv)
        if "descriptors" in top:
            _walk(file, conv, top["descriptors"][1], [], names, pending_replaces)
    for conv, entry, peer_name, line in pending_replaces:
        mapped = names.by_peer.get(peer_name)
        if mapped is None:  # the peer ignores a name no limit has
            conv.warnings.append(f"{conv.source}:{line}: replaces '{peer_name}': no limit has that name; left out")
            continue
        # the peer drops every limit of that name
        have = entry.setdefault("replaces", [])
        have.extend(name for name in mapped if name not in have)
    return out


def _walk(file: str, conv: Converted, node: yaml.Node, path: list[dict[str, str]], names: _Names,
          pending: list[tuple[Converted, dict[str, Any], str, int]]) -> None:
    if not isinstance(node, yaml.SequenceNode):
        raise ConvertError(file, _line(node), "descriptors is a list")
    seen: dict[str, int] = {}
    for item in node.value:
        d = _mapping(file, item, "a descriptor")
        if "key" not in d or not _scalar(file, d["key"][1], "key"):
            raise ConvertError(file, _line(item), "descriptor has empty key")
        key = _scalar(file, d["key"][1], "key")
        value = _scalar(file, d["value"][1], "value") if "value" in d else ""
        if len(path) >= MAX_DESCRIPTOR_ENTRIES:
            raise ConvertError(file, _line(item), f"a descriptor nested {len(path) + 1} deep: at most "
                               f"{MAX_DESCRIPTOR_ENTRIES} entries here")
        if len(key) > MAX_DESCRIPTOR_KEY:
            raise ConvertError(file, _line(d["key"][1]), f"a key of {len(key)} characters: at most "
                               f"{MAX_DESCRIPTOR_KEY} here")
        if len(value) > MAX_DESCRIPTOR_VALUE:
            raise ConvertError(file, _line(d["value"][1]), f"a value of {len(value)} characters: at most "
                               f"{MAX_DESCRIPTOR_VALUE} here")
        if "*" in value[:-1]:
            raise ConvertError(file, _line(d["value"][1]), f"value '{value}': a '*' before the end is a "
                               "wildcard to envoyproxy/ratelimit, a literal here: not converted (only a "
                               "trailing '*', a prefix, matches the same)")
        for what, why in NOT_CONVERTED.items():
            if what in d and (what == "metadata" or _bool(file, d[what][1], what)):
                raise ConvertError(file, _line(d[what][0]), f"'{what}' is not converted: {why}")
        if "value_to_metric" in d and _bool(file, d["value_to_metric"][1], "value_to_metric"):
            conv.warnings.append(f"{file}:{_line(d['value_to_metric'][0])}: value_to_metric: metrics only, "
                                 "not converted (the decisions are the same)")
        composite = f"{key}_{value}" if value else key
        if composite in seen:
            raise ConvertError(file, _line(item), f"duplicate descriptor composite key '{composite}' "
                               f"(first on line {seen[composite]})")
        seen[composite] = _line(item)
        entries = [*path, {"key": key, **({"value": value} if value else {})}]
        match = {"domain": conv.domain, "descriptor": entries}
        children = d.get("descriptors")
        if "rate_limit" in d:
            _limit(file, conv, d, match, names, pending)
        elif children is None or children[1].value == []:  # a leaf without a limit: the peer
            conv.unlimited.append({"match": match})  # applies none (no fallback to a default)
        for flag in ("shadow_mode", "detailed_metric"):
            if flag in d and "rate_limit" not in d:
                _bool(file, d[flag][1], flag)  # checked; no limit to apply it to
        if children is not None:
            _walk(file, conv, children[1], entries, names, pending)


def _limit(file: str, conv: Converted, d: dict[str, tuple[yaml.Node, yaml.Node]], match: dict[str, Any],
           names: _Names, pending: list[tuple[Converted, dict[str, Any], str, int]]) -> None:
    key_node, node = d["rate_limit"]
    rl = _mapping(file, node, "rate_limit")
    unlimited = "unlimited" in rl and _bool(file, rl["unlimited"][1], "unlimited")
    unit = _scalar(file, rl["unit"][1], "unit").lower() if "unit" in rl else ""
    peer_name = _scalar(file, rl["name"][1], "name") if "name" in rl else ""
    replaces: list[str] = []
    if "replaces" in rl:
        rep = rl["replaces"][1]
        if not isinstance(rep, yaml.SequenceNode):
            raise ConvertError(file, _line(rep), "replaces is a list of {name: ...}")
        for r in rep.value:
            item = _mapping(file, r, "a replaces entry")
            name = _scalar(file, item["name"][1], "name") if "name" in item else ""
            if not name:
                raise ConvertError(file, _line(r), "should not have an empty replaces entry")
            if name == peer_name:
                raise ConvertError(file, _line(r), "replaces should not contain name of same descriptor")
            replaces.append(name)
    shadow = "shadow_mode" in d and _bool(file, d["shadow_mode"][1], "shadow_mode")
    detailed = "detailed_metric" in d and _bool(file, d["detailed_metric"][1], "detailed_metric")
    shape = ".".join(e["key"] + ("_" + e["value"] if "value" in e else "") for e in match["descriptor"])
    wanted = peer_name or f"{conv.domain}.{shape}"
    name = names.make(wanted)
    if peer_name:
        names.by_peer.setdefault(peer_name, []).append(name)
    line = _line(key_node)
    if unlimited:
        if unit in UNITS:
            raise ConvertError(file, _line(rl["unit"][1]), "should not specify rate limit unit when unlimited")
        entry: dict[str, Any] = {"name": name, "match": match}
        conv.unlimited.append(entry)
    else:
        if unit not in UNITS:
            raise ConvertError(file, _line(rl["unit"][1]) if "unit" in rl else line,
                               f"invalid rate limit unit '{unit}'")
        raw = yaml.safe_load(yaml.serialize(rl["requests_per_unit"][1])) if "requests_per_unit" in rl else 0
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
            raise ConvertError(file, line, "requests_per_unit is a whole number")
        if raw == 0:
            raise ConvertError(file, _line(rl["requests_per_unit"][1]) if "requests_per_unit" in rl else line,
                               "requests_per_unit 0 refuses every request: not converted (a quota's limit "
                               "is at least 1; block these requests in Envoy instead)")
        if raw > MAX_COUNT:
            conv.warnings.append(f"{file}:{_line(rl['requests_per_unit'][1])}: requests_per_unit {raw}: at most "
                                 f"{MAX_COUNT} here, converted to that")
        entry = {"name": name, "type": "quota", "limit": min(raw, MAX_COUNT), "period": unit}
        if shadow:
            entry["mode"] = "shadow"
        entry["match"] = match
        if detailed:
            entry["detailed_metric"] = True
        conv.limiters.append(entry)
        if unit in CALENDAR_UNITS:
            conv.warnings.append(f"{file}:{line}: unit {unit}: calendar {unit}s in UTC here, the peer's are "
                                 "fixed 7-, 30- or 365-day windows from the epoch (docs/migrating.md)")
    for peer in replaces:
        pending.append((conv, entry, peer, line))


def convert_paths(paths: Sequence[str]) -> list[Converted]:
    """The files (a directory: its ``*.yaml``/``*.yml``) converted together."""
    files: list[tuple[str, str]] = []
    for p in map(Path, paths):
        found = sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml")) if p.is_dir() else [p]
        for f in found:
            try:
                files.append((str(f), f.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as exc:
                raise ConvertError(str(f), 1, f"cannot read: {exc}") from None
    return convert(files)
