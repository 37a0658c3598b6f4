"""Qwix quantization (QAT, PTQ; int8, fp8): layouts, forward parity and error bounds, hygiene."""

import pytest

from conformance.quant_checks import (
    check_quant_checkpoint,
    check_quant_forward,
    check_quant_hygiene,
    check_quant_params,
)
from conformance.runtime.quant import known_failure
from conformance.train_checks import check_train_step


@pytest.mark.golden
def test_quant_params(family, mesh, scan_layers, quant, golden):
    config = family.config(family.device_size, scan_layers=scan_layers)
    golden.check(check_quant_params(family, config, mesh, quant))


@pytest.mark.known_failure(lambda quant, scan_layers, **_: known_failure(quant, scan_layers))
def test_quant_forward(family, mesh, scan_layers, quant, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_quant_forward(family, config, mesh, device_mesh, quant)


def test_quant_hygiene(family, scan_layers, quant, primary_mesh):
    mesh, _ = primary_mesh
    check_quant_hygiene(
        family, family.config(family.device_size, scan_layers=scan_layers), mesh, quant
    )


TOPOLOGY_MODE = "qat_fp8"
"""The Qwix mode ``quant_hygiene_topology`` quantizes production sizes with (fp8, as the
large training workloads do)."""


def test_quant_hygiene_topology(family, full_size, topology):
    """Production sizes in the preferred layout, abstractly: nothing transient is left."""
    if TOPOLOGY_MODE not in family.capabilities.quantization:
        pytest.skip(f"{family.name} does not declare {TOPOLOGY_MODE}")
    layout = family.capabilities.preferred_scan_layers
    config = family.config(full_size, scan_layers=layout)
    check_quant_hygiene(family, config, topology, TOPOLOGY_MODE)


@pytest.mark.quant_method("qat")
def test_qat_train_step(family, mesh, scan_layers, quant, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_train_step(family, config, mesh, device_mesh, quant)


@pytest.mark.quant_method("ptq")
def test_quant_checkpoint(family, scan_layers, quant, primary_mesh, shared_tmp_path):
    mesh, devices = primary_mesh
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_quant_checkpoint(
        family, config, mesh, devices, quant, shared_tmp_path, scan_layers=scan_layers
    )
