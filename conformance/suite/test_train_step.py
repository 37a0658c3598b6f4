"""Train step: parity across backends, accumulation, layout variants, hygiene, dropout,
vocab tiling, FP8, auxiliary losses."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
