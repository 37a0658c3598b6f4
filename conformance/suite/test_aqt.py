"""AQT (aqtp) int8: TRAIN parity and error bound, CONVERT layout and parity, SERVE from orbax."""

import pytest

from conformance.aqt_checks import (
    check_aqt_convert,
    check_aqt_forward,
    check_aqt_layout,
    check_aqt_serve,
    check_aqt_train_step,
)
from conformance.runtime.aqt import known_failure

pytestmark = pytest.mark.capability("aqt")


def test_aqt_forward(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_aqt_forward(family, config, mesh, device_mesh)


def test_aqt_train_step(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_aqt_train_step(family, config, mesh, device_mesh)


@pytest.mark.golden
@pytest.mark.known_failure(lambda scan_layers, **_: known_failure("aqt_layout", scan_layers))
def test_aqt_layout(family, mesh, scan_layers, golden):
    config = family.config(family.device_size, scan_layers=scan_layers)
    golden.check(check_aqt_layout(family, config, mesh))


def test_aqt_convert(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_aqt_convert(family, config, mesh, device_mesh)


def test_aqt_serve(family, scan_layers, primary_mesh, shared_tmp_path):
    mesh, devices = primary_mesh
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_aqt_serve(family, config, mesh, devices, shared_tmp_path, scan_layers=scan_layers)
