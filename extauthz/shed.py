"""The worker utilization shed level, and the tier mapping it drives.

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

The controller step is :func:`extauthz.store.algorithms.shed_advance`: the store runs it
(``Store.shed_update``) against the state it keeps, one state per fleet on Redis.

Tier mapping (:func:`drop_probabilities`): the positive part of the level is split into
three equal thirds driving ``test``, then ``get``, then ``post``::

    p_test = clamp(3L)   p_get = clamp(3L - 1)   p_post = clamp(3L - 2)   p_critical = 0

so at every moment test >= get >= post >= critical = 0, the mean over the three tiers
equals the gist's single drop chance ``max(L, 0)``, and recovery retraces the same path.
"""

from __future__ import annotations

from .store.algorithms import clamp
from .tiers import Tier


def drop_probabilities(level: float) -> dict[Tier, float]:
    """Per-tier drop probability for a shed level (see the module docstring)."""
    x = 3.0 * level
    return {
        Tier.TEST: clamp(x, 0.0, 1.0),
        Tier.GET: clamp(x - 1.0, 0.0, 1.0),
        Tier.POST: clamp(x - 2.0, 0.0, 1.0),
        Tier.CRITICAL: 0.0,
    }
