"""Qwix quantization (QAT, PTQ; int8, fp8): layouts, forward parity and error bounds, hygiene."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
