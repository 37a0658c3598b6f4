"""Checkpoints: orbax round trips (same mesh and resharded) and Linen <-> NNX conversion."""


def test_checkpoint_roundtrip(conformance_case):
    conformance_case.run()


def test_checkpoint_conversion(conformance_case):
    conformance_case.run()
