"""Sharding invariance: each backend on the mesh equals itself on one device."""


def test_sharding_invariance(conformance_case):
    conformance_case.run()
