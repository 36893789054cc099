"""The store contract suite (every store) and Redis-specific tests."""
