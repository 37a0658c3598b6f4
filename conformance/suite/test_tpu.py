"""TPU compiles: both sides' programs compiled for a TPU slice cost alike, and fit."""


def test_tpu_compile(conformance_case):
    conformance_case.run()
