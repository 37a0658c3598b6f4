"""Checkpoints: orbax round trips (same mesh and resharded) and Linen <-> NNX conversion."""

import pytest

from conformance.checkpoint_checks import check_checkpoint_conversion, check_checkpoint_roundtrip
from conformance.runtime.checkpoints import CheckpointInfo

LAYOUT_PAIRS = {
    "loop-loop": (False, False),
    "scan-scan": (True, True),
    "loop-scan": (False, True),
    "scan-loop": (True, False),
}
"""Source and target layer layouts (``scan_layers``) of each conversion."""


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_checkpoint_roundtrip(
    family, mesh, scan_layers, device_mesh, primary_mesh, backend, shared_tmp_path
):
    info = CheckpointInfo(family.name, family.device_size, backend, scan_layers)
    check_checkpoint_roundtrip(family, info, primary_mesh, (mesh, device_mesh), shared_tmp_path)


@pytest.mark.parametrize("source", ["linen", "nnx"])
@pytest.mark.parametrize(
    "layouts",
    [pytest.param(name, marks=pytest.mark.layouts(*pair)) for name, pair in LAYOUT_PAIRS.items()],
)
def test_checkpoint_conversion(family, primary_mesh, source, layouts, shared_tmp_path):
    source_scan, target_scan = LAYOUT_PAIRS[layouts]
    info = CheckpointInfo(family.name, family.device_size, source, source_scan)
    check_checkpoint_conversion(family, info, target_scan, *primary_mesh, shared_tmp_path)
