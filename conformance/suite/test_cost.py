"""Compiled cost: NNX's programs cost no more than Linen's and run the same collectives."""


def test_cost(conformance_case):
    conformance_case.run()
