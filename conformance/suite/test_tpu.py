"""TPU compiles: both sides' programs compiled for a TPU slice cost alike, and fit."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
