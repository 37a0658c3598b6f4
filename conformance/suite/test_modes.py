"""Two modes of one backend: NNX in graph mode against NNX in tree mode."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
