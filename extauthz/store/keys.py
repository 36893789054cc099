"""Every store key is built here.

``{prefix}:{tag}:{what}`` where ``{tag}`` is a Redis Cluster hash tag: all keys of one
user share the tag ``{u:<hash>}`` (one slot, so a multi-key script works on a cluster);
fleet-wide keys share ``{fleet}``. Identities are already hashed by the classifier.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ..core.settings import KEY_PREFIX

#: a limiter name (policy schema ``Name``) and a hashed identity (classify.hash_identity).
_NAME = r"[a-z0-9][a-z0-9_.-]{0,62}"
#: (the one pattern: :func:`extauthz.policy.classify.valid_hash` matches it; here, the lightest module
#: that needs it, so that the command line imports it without the policy's models)
IDENTITY_HASH_PATTERN = r"[0-9a-f]{24}"
_IDENTITY = IDENTITY_HASH_PATTERN


@functools.lru_cache(maxsize=8)
def _lease_key_pattern(prefix: str) -> re.Pattern[str]:
    p = re.escape(prefix)
    return re.compile(rf"{p}:\{{u:{_IDENTITY}\}}:cc:{_NAME}|{p}:\{{fleet\}}:fl:{_NAME}:(?:critical|other|all)")


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = KEY_PREFIX

    def user_tag(self, identity: str) -> str:
        return f"{{u:{identity}}}"

    @property
    def fleet_tag(self) -> str:
        return "{fleet}"

    def bucket(self, limiter: str, identity: str) -> str:
        """A token bucket: one STRING ``"<tokens> <ts>"`` (``lua/check.lua``). ``rr2``: the
        second layout; the first (``rr``, a HASH) is never read, so that old and new servers
        keep separate buckets during a rolling upgrade instead of meeting a WRONGTYPE."""
        return f"{self.prefix}:{self.user_tag(identity)}:rr2:{limiter}"

    def quota(self, limiter: str, identity: str, window_start: int) -> str:
        """A quota window's count (a STRING integer): one key per window, named by the
        window's start (Unix seconds, UTC), so a new window starts from nothing."""
        return f"{self.prefix}:{self.user_tag(identity)}:q:{limiter}:{window_start}"

    def user_leases(self, limiter: str, identity: str) -> str:
        return f"{self.prefix}:{self.user_tag(identity)}:cc:{limiter}"

    def fleet_leases(self, limiter: str, group: str) -> str:
        """``group`` is ``critical`` or ``other`` (fleet usage), or ``all``."""
        return f"{self.prefix}:{self.fleet_tag}:fl:{limiter}:{group}"

    def quota_ledger(self, limiter: str, bucket: str, part: str) -> str:
        """The rate limit quota service's ledger of one Envoy bucket (``SliceOp``: a HASH of
        slices by holder): ``bucket`` the bucket id's digest, ``part`` ``fill`` or ``burst``.
        Both parts of a bucket share the tag ``{ql:<bucket>}`` (one slot: one atomic call)."""
        return f"{self.prefix}:{{ql:{bucket}}}:ql:{limiter}:{part}"

    @property
    def quota_marker(self) -> str:
        """The quota ledger's marker (``SliceOp`` slices: one per replica, long-lived, and a
        reset flag while a lost ledger's assignments run out): a store that lost its data has
        none (:class:`~extauthz.engine.quota_service.StoreLedger`). Its own tag ``{qlm}``."""
        return f"{self.prefix}:{{qlm}}:qlm"

    def shed_state(self, limiter: str) -> str:
        return f"{self.prefix}:{self.fleet_tag}:shed:{limiter}"

    def signal(self, limiter: str) -> str:
        return f"{self.prefix}:signal:{limiter}"

    @property
    def switches(self) -> str:
        return f"{self.prefix}:switches"

    @property
    def overrides(self) -> str:
        """Live per-customer overrides: one JSON value (``extauthz.control.overrides``)."""
        return f"{self.prefix}:overrides"

    @property
    def overrides_version(self) -> str:
        """Changes with every override change; replicas poll it, then read :attr:`overrides`."""
        return f"{self.prefix}:overrides:version"

    @property
    def shadow_log(self) -> str:
        return f"{self.prefix}:shadow"

    @property
    def history(self) -> str:
        """Who changed a kill switch or an override, and why: a bounded event log
        (``extauthz.control.changelog``; ``Store.append_events``)."""
        return f"{self.prefix}:history"

    def is_lease_key(self, key: str) -> bool:
        """True for a key :meth:`user_leases` or :meth:`fleet_leases` can build, with this
        prefix: the only keys a lease release may touch."""
        return _lease_key_pattern(self.prefix).fullmatch(key) is not None

    @staticmethod
    def limiter_of(key: str) -> str | None:
        """The limiter a per-user key built here belongs to (:meth:`bucket`, :meth:`quota`,
        :meth:`user_leases`: ``...{u:<identity>}:<kind>:<limiter>[:<window>]``); None for
        any other key (fleet-wide keys, values, event logs)."""
        start = key.find("{u:")
        if start < 0:
            return None
        end = key.find("}:", start)
        if end < 0:
            return None
        parts = key[end + 2:].split(":", 2)
        return parts[1] if len(parts) > 1 else None

    @staticmethod
    def tag_of(key: str) -> str:
        """The hash tag of a key built here (the part between the first ``{`` and ``}``)."""
        start = key.find("{")
        end = key.find("}", start + 1)
        return key[start + 1:end] if start >= 0 and end > start else key
