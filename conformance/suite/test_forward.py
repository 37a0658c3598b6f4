"""Forward: logits agree after transplanting parameters in both directions."""

from conformance.suite import check_tests

globals().update(check_tests(__name__))
