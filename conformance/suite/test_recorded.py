"""Recorded references: each live backend against what a backend computed when recorded."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
