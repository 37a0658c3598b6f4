"""Sharding: the same PartitionSpec per leaf on both sides, even splits, goldens per mesh.

``test_sharding`` runs the device-size config on device meshes and also checks where arrays are
placed; ``test_sharding_topology`` evaluates full-size configs on abstract production
meshes, without devices or parameter memory.
"""

import pytest

from conformance.checks import check_sharding


@pytest.mark.golden
def test_sharding(family, mesh, scan_layers, device_mesh, golden):
    config = family.config(family.device_size, scan_layers=scan_layers)
    golden.check(check_sharding(family, config, mesh, device_mesh))


@pytest.mark.golden
def test_sharding_topology(family, full_size, topology, scan_layers, golden):
    config = family.config(full_size, scan_layers=scan_layers)
    golden.check(check_sharding(family, config, topology))
