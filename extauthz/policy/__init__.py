"""Policy: strict schema, loader with file/path/line errors, and the compiled form."""

from .loader import load_policy
from .model import Matcher, Policy

__all__ = ["Matcher", "Policy", "load_policy"]
