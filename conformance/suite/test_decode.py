"""Prefill and decode: the KV cache's layout, self-consistency per backend, Linen/NNX parity."""

import pytest

from conformance.decode_checks import check_decode, check_decode_cache, check_decode_consistency

pytestmark = pytest.mark.capability("decode")


@pytest.mark.golden
def test_decode_cache(family, mesh, scan_layers, device_mesh, golden):
    config = family.config(family.device_size, scan_layers=scan_layers)
    golden.check(check_decode_cache(family, config, mesh, device_mesh))


def test_decode_consistency(family, mesh, scan_layers, device_mesh):
    check_decode_consistency(
        family, family.config(family.device_size, scan_layers=scan_layers), mesh, device_mesh
    )


def test_decode(family, mesh, scan_layers, device_mesh):
    check_decode(
        family, family.config(family.device_size, scan_layers=scan_layers), mesh, device_mesh
    )
