"""Init: both sides' initialisers agree in distribution, per leaf."""


def test_init(conformance_case):
    conformance_case.run()
