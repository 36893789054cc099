"""The four traffic tiers, most important first."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    CRITICAL = "critical"
    POST = "post"
    GET = "get"
    TEST = "test"


#: Methods that default to the ``get`` tier when nothing else names a tier.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
