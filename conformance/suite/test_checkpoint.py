"""Checkpoints: orbax round trips (same mesh and resharded) and Linen <-> NNX conversion."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
