"""State hygiene outside training: forwards leave the NNX model's state as it was built."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
