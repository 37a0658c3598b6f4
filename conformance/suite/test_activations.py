"""Activation shardings: how each side's compiled forward lays out every module call's values."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
