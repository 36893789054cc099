"""Stores: the embedded memory store and the Redis store, behind one contract."""

from .base import BucketOp, CheckResult, CountOp, LeaseOp, Op, OpResult, ShedParams, Store
from .keys import Keys

__all__ = ["BucketOp", "CheckResult", "CountOp", "Keys", "LeaseOp", "Op", "OpResult", "ShedParams", "Store"]
