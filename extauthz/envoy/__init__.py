"""Envoy configuration the server hands out: the rate limit quota filter (rlqs.py)."""
