"""The worker utilization controller from Stripe's gist, and the tier mapping it drives.

The controller keeps one number, the shed *level*, in ``[resting, 1]`` where
``resting = -delay_before_shedding / time_to_shed_all`` (computed in floating point; the
gist's Ruby divides integers and gets -1). On every utilization sample:

* below ``good_below`` the level falls at up to ``1 / time_to_shed_all`` per second,
  proportionally to how far below; between ``good_below`` and ``bad_above`` it holds
  (the dead zone); above ``bad_above`` it rises at up to ``1 / time_to_shed_all`` per second;
* the elapsed time used per update is clamped to ``[0, delay_before_shedding]`` so a
  long pause between samples cannot jump the level.

Starting from rest, sustained full utilization therefore sheds nothing for
``delay_before_shedding`` seconds and everything non-critical after
``delay_before_shedding + time_to_shed_all``.

Tier mapping (:func:`drop_probabilities`): the positive part of the level is split into
three equal thirds driving ``test``, then ``get``, then ``post``::

    p_test = clamp(3L)   p_get = clamp(3L - 1)   p_post = clamp(3L - 2)   p_critical = 0

so at every moment test >= get >= post >= critical = 0, the mean over the three tiers
equals the gist's single drop chance ``max(L, 0)``, and recovery retraces the same path.
"""

from __future__ import annotations

from .store.base import ShedParams
from .tiers import Tier


def clamp(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


def derivative(utilization: float, p: ShedParams) -> float:
    """Level change per second for a utilization sample (the gist's derivative)."""
    if utilization < p.good_below:
        amount = utilization / p.good_below - 1.0
    elif utilization < p.bad_above:
        amount = 0.0
    else:
        amount = (utilization - p.bad_above) / (1.0 - p.bad_above)
    return clamp(amount, -1.0, 1.0) / p.time_to_shed_all


def advance(level: float | None, last: float | None, now: float, utilization: float,
            p: ShedParams) -> float:
    """The level after a sample taken at ``now``. A new controller starts at rest."""
    if level is None or last is None:
        return p.resting
    elapsed = clamp(now - last, 0.0, p.delay_before_shedding)
    return clamp(level + elapsed * derivative(utilization, p), p.resting, 1.0)


def drop_probabilities(level: float) -> dict[Tier, float]:
    """Per-tier drop probability for a shed level (see the module docstring)."""
    x = 3.0 * level
    return {
        Tier.TEST: clamp(x, 0.0, 1.0),
        Tier.GET: clamp(x - 1.0, 0.0, 1.0),
        Tier.POST: clamp(x - 2.0, 0.0, 1.0),
        Tier.CRITICAL: 0.0,
    }
