"""AQT (aqtp) int8: TRAIN parity and error bound, CONVERT layout and parity, SERVE from orbax."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
