"""Forward: logits agree after transplanting parameters in both directions."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
