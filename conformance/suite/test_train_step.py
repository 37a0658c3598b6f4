"""Train step: parity across backends, accumulation, layout variants, hygiene, dropout,
vocab tiling, FP8."""

import pytest

from conformance.tiling_checks import check_vocab_tiling
from conformance.train_checks import (
    check_dropout,
    check_fp8_train_step,
    check_grad_accumulation,
    check_hygiene,
    check_layout_invariance,
    check_optimizer_sharding,
    check_train_step,
)


def test_train_step(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_train_step(family, config, mesh, device_mesh)


def test_grad_accumulation(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_grad_accumulation(family, config, mesh, device_mesh)


@pytest.mark.layouts(False)
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("remat", marks=pytest.mark.capability("remat")),
        pytest.param("scan_layers", marks=pytest.mark.layouts(True)),
    ],
)
def test_layout(family, mesh, device_mesh, variant):
    check_layout_invariance(family, family.device_size, mesh, device_mesh, variant)


def test_hygiene(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_hygiene(family, config, mesh, device_mesh)


@pytest.mark.golden
def test_optimizer_sharding(family, mesh, scan_layers, golden):
    config = family.config(family.device_size, scan_layers=scan_layers)
    golden.check(check_optimizer_sharding(family, config, mesh))


@pytest.mark.capability("dropout")
def test_dropout(family, scan_layers, primary_mesh):
    mesh, devices = primary_mesh
    check_dropout(family, family.config(family.device_size, scan_layers=scan_layers), mesh, devices)


@pytest.mark.capability("vocab_tiling")
def test_vocab_tiling(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_vocab_tiling(family, config, mesh, device_mesh)


@pytest.mark.capability("fp8")
def test_fp8_train_step(family, scan_layers, primary_mesh):
    mesh, devices = primary_mesh
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_fp8_train_step(family, config, mesh, devices)
