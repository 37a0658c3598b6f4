"""Compiled cost: NNX's programs cost no more than Linen's and run the same collectives."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
