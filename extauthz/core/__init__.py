"""Core: the types, settings and small tools every layer uses (no package imports above it)."""
