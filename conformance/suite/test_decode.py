"""Prefill and decode: the KV cache's layout, self-consistency per backend, Linen/NNX parity."""


def test_decode_cache(conformance_case):
    conformance_case.run()


def test_decode_consistency(conformance_case):
    conformance_case.run()


def test_decode(conformance_case):
    conformance_case.run()
