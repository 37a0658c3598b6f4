"""Sharding invariance: each backend on the mesh equals itself on one device."""

import pytest

from conformance.invariance_checks import BACKENDS, check_sharding_invariance


@pytest.mark.parametrize("backend", BACKENDS, ids=str.lower)
def test_sharding_invariance(family, mesh, scan_layers, device_mesh, backend):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_sharding_invariance(family, config, mesh, device_mesh, backend)
