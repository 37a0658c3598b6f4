"""Checks installed zoos register themselves (the ``conformance.checks`` entry points)."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
