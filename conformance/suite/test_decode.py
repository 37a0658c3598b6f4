"""Prefill and decode: the KV cache's layout, self-consistency per backend, Linen/NNX parity."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
