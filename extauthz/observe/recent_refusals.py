"""The recent refusals of this server, by identity hash (``extauthz inspect``,
``GET /customers/<hash>``): "whether the last requests were refused and by what".

Nothing else keeps refusals per customer cheaply: the shadow recorder keeps only shadow
limiters' would-denials, the decision log is lines on stdout. So each replica keeps a small
bounded ring: the last :data:`PER_IDENTITY` refusals of each of the last :data:`IDENTITIES`
identities refused (least recently refused forgotten first). It holds the hash, never the key,
and covers this replica only, since it started.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.settings import RECENT_REFUSALS_PER_IDENTITY
from ..core.verdict import Decision
from ..policy.model import Policy
from .base import ObserverBase

#: refusals kept per identity
PER_IDENTITY = RECENT_REFUSALS_PER_IDENTITY
#: identities kept (about 364 bytes a refusal, measured with tracemalloc in bench.memory_soak
#: (docs/benchmarks.md, issue 31): about 7 MiB when every identity holds PER_IDENTITY)
IDENTITIES = 1000


@dataclass(eq=False)
class RecentRefusals(ObserverBase):
    """An observer: each refused decision (enforced, or a shadow limiter's would-deny) is
    kept as ``{at, limiter, reason, outcome, enforced, tier, status, retry_after}``: ``status``
    is the answer the request got (the decision's: 429 when another limiter refused it, 200
    when nothing did), ``enforced`` whether this limiter's refusal was that answer's."""

    clock: Clock = SYSTEM_CLOCK
    per_identity: int = PER_IDENTITY
    identities: int = IDENTITIES
    _rings: OrderedDict[str, deque[dict[str, Any]]] = field(default_factory=OrderedDict)

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        refused = [v for v in decision.verdicts if v.refused or v.would_deny]
        if not refused:
            return
        ring = self._rings.get(ctx.identity)
        if ring is None:
            ring = self._rings[ctx.identity] = deque(maxlen=self.per_identity)
            if len(self._rings) > self.identities:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(ctx.identity)
        at, status = round(self.clock.wall(), 3), decision.http_status
        for v in refused:
            ring.append({"at": at, "limiter": v.limiter, "reason": v.reason, "outcome": v.outcome.value,
                         "enforced": v.refused, "tier": ctx.tier.value, "status": status,
                         "retry_after": v.retry_after})

    def of(self, identity: str) -> list[dict[str, Any]]:
        """The identity's kept refusals, oldest first."""
        return list(self._rings.get(identity, ()))

    def describe(self) -> dict[str, Any]:
        return {"covers": f"this replica only, since it started: the last {self.per_identity} "
                f"refusals of each of the last {self.identities} identities refused"}
