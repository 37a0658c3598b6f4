"""Reference model families, each written twice: once with Flax Linen, once with Flax NNX."""

from pathlib import Path

GOLDENS = Path(__file__).resolve().parent / "goldens"
"""The built-in families' goldens and recorded references, shipped in this package."""
