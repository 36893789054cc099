"""One customer's state at a glance (``extauthz inspect``, ``GET /customers/<hash>``).

For a hashed identity (:func:`~extauthz.policy.classify.hash_identity`: the key itself never
reaches this module), every limiter of the policy: whether it counts per this identity, its
mode, its numbers (the plan's, and a live override's when one applies), and the live
counters read from the store without changing them (:meth:`~extauthz.store.base.Store.peek`):
tokens left and the seconds until the bucket is full, requests in flight, the quota window's
count and when it resets. Fleet-wide shedders have no per-customer state (their numbers are
shown, not counters). The server adds what only it knows: the grants its replica holds, and
the recent refusals it made (:class:`~extauthz.observe.recent_refusals.RecentRefusals`).

Both the admin route and the CLI's ``--redis-url`` path call :func:`customer_view`, so the
answer has one shape and one set of rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.verdict import Limits, Mode
from ..limiters.base import Limiter, PerCustomer
from ..limiters.grants import GrantTable
from ..limiters.quota import QuotaLimiter
from ..policy.classify import valid_hash
from ..policy.model import Policy
from ..store.base import PeekOp, Store
from ..store.keys import Keys
from .overrides import Override, compile_overrides, live
from .switches import Switches


def _numbers(kind: str, n: Limits) -> dict[str, float]:
    if kind == "request_rate":
        return {"rate": n.rate, "burst": n.burst, "cost": n.cost}
    return {"limit": n.limit}


def _spec_of(policy: Policy, name: str) -> Any:
    return next(s for s in policy.limiters if s.name == name)


async def customer_view(identity: str, *, policy: Policy, limiters: Sequence[Limiter], store: Store,
                        keys: Keys, overrides: Sequence[Override], switches: Switches,
                        wall: float, plan: str | None = None) -> dict[str, Any]:
    """The customer's limiters and live counters (JSON-ready). ``plan``: the customer's plan
    (the plan comes with each request, not with the identity), by default the policy's
    default plan; ``wall``: now (Unix seconds) for the quota windows and the overrides."""
    if not valid_hash(identity):
        raise ValueError(f"not an identity hash (24 hex digits, as `extauthz hash` prints): {identity[:40]!r}")
    plan = policy.plan_default if plan is None else plan.strip().lower()
    if plan and policy.plan_names and plan not in policy.plan_names:
        raise ValueError(f"the policy has no plan {plan!r} (its plans: {', '.join(sorted(policy.plan_names))})")
    mine = [o for o in live(overrides, wall) if o.identity == identity]
    table, not_applied = compile_overrides(mine, limiters, wall, policy.identity_labels)
    rows: list[dict[str, Any]] = []
    peeks: list[tuple[dict[str, Any], PeekOp, Limits]] = []
    for lim in limiters:
        spec = _spec_of(policy, lim.name)
        mode = Mode(spec.mode)
        row: dict[str, Any] = {"limiter": lim.name, "type": spec.type, "policy_mode": mode.value,
                               "mode": switches.effective(lim.name, mode).value}
        rows.append(row)
        if not isinstance(lim, PerCustomer):
            row["per_customer"] = False
            row["note"] = "limits the whole fleet or this replica: no per-customer counters"
            continue
        row["per_customer"] = True
        row["plans"] = {name or "(own)": _numbers(spec.type, n) for name, n in
                        {"": lim.own, **lim.plans}.items()}
        by_plan = table.get(identity, {}).get(lim.name)
        n = (by_plan.get(plan) or by_plan[""]) if by_plan is not None else lim.plans.get(plan, lim.own)
        row["numbers"] = _numbers(spec.type, n)
        row["numbers_from"] = ("override" if by_plan is not None
                               else f"plan {plan}" if plan in lim.plans else "limiter")
        over = next((o for o in mine if o.limiter == lim.name), None)
        if over is not None:
            row["override"] = {"numbers": dict(over.numbers), "expires_at": over.expires_at,
                               "reason": over.reason, "by": over.by,
                               **({"not_applied": not_applied[(lim.name, identity)]}
                                  if (lim.name, identity) in not_applied else {})}
        if lim.key.index is not None:
            row["note"] = ("counts per its own key (policy `key`), not per identity alone: no "
                           "counters for an identity")
            continue
        if spec.type == "request_rate":
            op = PeekOp("bucket", keys.bucket(lim.name, identity), n.rate, n.burst)
        elif isinstance(lim, QuotaLimiter):
            start, end = lim.window(wall)
            row["window"] = {"start": start, "end": end, "resets_in": round(end - wall, 3)}
            op = PeekOp("count", keys.quota(lim.name, identity, start))
        else:
            op = PeekOp("leases", keys.user_leases(lim.name, identity))
        peeks.append((row, op, n))
    values = await store.peek([op for _, op, _ in peeks])
    for (row, op, n), value in zip(peeks, values, strict=True):
        if op.kind == "bucket":
            row["live"] = {"tokens": round(value, 6), "full_in": round((n.burst - value) / n.rate, 6),
                           "requests_left": int((value + 1e-9) // n.cost) if n.cost else None}
        elif op.kind == "count":
            row["live"] = {"used": int(value), "left": max(0, n.limit - int(value))}
        else:
            row["live"] = {"in_flight": int(value), "left": max(0, n.limit - int(value)) if n.limit else None}
    return {"identity": identity, "plan": plan or None, "policy_version": policy.version,
            "limiters": rows}


def held_grants(view: dict[str, Any], limiters: Sequence[Limiter], keys: Keys, wall: float) -> None:
    """Add the grants this replica holds (``consistency: batched``) to ``view``'s rows: the
    tokens or quota units taken from the store and not spent yet, which the store's counters
    no longer show (other replicas' grants are out of the store's counters too)."""
    identity = view["identity"]
    by_name: Mapping[str, Limiter] = {lim.name: lim for lim in limiters}
    for row in view["limiters"]:
        lim = by_name.get(row["limiter"])
        grants = lim.grants if lim is not None else None
        if not isinstance(grants, GrantTable) or "live" not in row:  # the keyed limiters' tables
            continue
        if row["type"] == "request_rate":
            key = keys.bucket(row["limiter"], identity)
        else:
            key = keys.quota(row["limiter"], identity, int(row["window"]["start"]))
        row["live"]["held_by_this_replica"] = grants.held(key)
