"""Every store key is built here.

``{prefix}:{tag}:{what}`` where ``{tag}`` is a Redis Cluster hash tag: all keys of one
user share the tag ``{u:<hash>}`` (one slot, so a multi-key script works on a cluster);
fleet-wide keys share ``{fleet}``. Identities are already hashed by the classifier.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "extauthz"

    def user_tag(self, identity: str) -> str:
        return f"{{u:{identity}}}"

    @property
    def fleet_tag(self) -> str:
        return "{fleet}"

    def bucket(self, limiter: str, identity: str) -> str:
        return f"{self.prefix}:{self.user_tag(identity)}:rr:{limiter}"

    def user_leases(self, limiter: str, identity: str) -> str:
        return f"{self.prefix}:{self.user_tag(identity)}:cc:{limiter}"

    def fleet_leases(self, limiter: str, group: str) -> str:
        """``group`` is ``critical`` or ``other`` (fleet usage), or ``all``."""
        return f"{self.prefix}:{self.fleet_tag}:fl:{limiter}:{group}"

    def shed_state(self, limiter: str) -> str:
        return f"{self.prefix}:{self.fleet_tag}:shed:{limiter}"

    def signal(self, limiter: str) -> str:
        return f"{self.prefix}:signal:{limiter}"

    @property
    def switches(self) -> str:
        return f"{self.prefix}:switches"

    @property
    def shadow_log(self) -> str:
        return f"{self.prefix}:shadow"

    @staticmethod
    def tag_of(key: str) -> str:
        """The hash tag of a key built here (the part between the first ``{`` and ``}``)."""
        start = key.find("{")
        end = key.find("}", start + 1)
        return key[start + 1:end] if start >= 0 and end > start else key
