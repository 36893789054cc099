"""The four traffic tiers, most important first."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    CRITICAL = "critical"
    POST = "post"
    GET = "get"
    TEST = "test"


#: Shedding order: the first tier in this tuple is shed first.
SHED_ORDER: tuple[Tier, ...] = (Tier.TEST, Tier.GET, Tier.POST)

#: Methods that default to the ``get`` tier when nothing else names a tier.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
