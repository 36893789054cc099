"""``--identities FILE`` (``extauthz simulate`` and ``extauthz report``): customers named by
their keys, hashed as the server hashes them; only the names are ever shown."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class IdentityFile:
    """``--identities FILE``: one customer a line, ``NAME<TAB>KEY`` (or the KEY alone),
    the key hashed with the salt for each of the policy's identity rules as the server hashes
    them. Only the NAME is ever shown (a line with the key alone is shown as ``line N``):
    never the key."""

    path: str
    #: hash -> the name shown (NAME, or ``line N``)
    labels: dict[str, str]
    #: (line number, the hashes of that line)
    entries: list[tuple[int, set[str]]]
    #: NAME -> the hashes of its line (``--fail-on 'customer:NAME ...'``)
    names: dict[str, set[str]]

    @classmethod
    def read(cls, path: str, policy: Any, salt: bytes) -> IdentityFile:
        labels: dict[str, str] = {}
        entries: list[tuple[int, set[str]]] = []
        names: dict[str, set[str]] = {}
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, tab, raw = line.rpartition("\t")
            name = name.strip()
            if tab and not name:
                raise ValueError(f"--identities {path} line {lineno}: no NAME before the tab (NAME<TAB>KEY)")
            try:
                hashes = set(key_hashes(raw, policy, salt))
            except ValueError as exc:
                raise ValueError(f"--identities {path} line {lineno}: {exc}") from None
            shown = name or f"line {lineno}"
            labels.update(dict.fromkeys(hashes, shown))
            entries.append((lineno, hashes))
            if name:
                names.setdefault(name, set()).update(hashes)
        return cls(path, labels, entries, names)

    def unmatched(self, seen: Mapping[str, int]) -> list[int]:
        """The line numbers of entries no request of the traffic carried."""
        return [lineno for lineno, hashes in self.entries if not any(seen.get(h) for h in hashes)]


def key_hashes(raw: str, policy: Any, salt: bytes) -> list[str]:
    """``raw`` (an API key, a customer's identity value) hashed for each of the policy's
    identity rules, as the server hashes it."""
    from ...policy.classify import key_identity_hash

    if not raw.strip():
        raise ValueError("no key")
    return [key_identity_hash(raw, rule, rule.label, salt) for rule in policy.identity]
