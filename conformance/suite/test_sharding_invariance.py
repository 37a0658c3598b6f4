"""Sharding invariance: each backend on the mesh equals itself on one device."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
