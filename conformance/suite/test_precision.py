"""Precision: the dtypes each side computes in, and training in bfloat16 compute."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
