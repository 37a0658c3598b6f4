"""Sharding: the same PartitionSpec per leaf on both sides, even splits, goldens per mesh.

``test_sharding`` runs the device-size config on device meshes and also checks where arrays
are placed; ``test_sharding_topology`` evaluates full-size configs on abstract production
meshes, without devices or parameter memory.
"""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
