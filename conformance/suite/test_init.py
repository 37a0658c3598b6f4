"""Init: both sides' initialisers agree in distribution, per leaf."""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
