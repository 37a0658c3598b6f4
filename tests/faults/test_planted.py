"""Each planted fault must make its intended check fail, naming the right leaf path."""

import pytest

from conformance.checks import (
    CheckFailure,
    check_forward,
    check_init,
    check_sharding,
    check_structure,
)
from conformance.sharding import parse_mesh
from conformance.train_checks import (
    check_grad_accumulation,
    check_hygiene,
    check_optimizer_sharding,
    check_train_step,
)
from tests.faults.catalogue import FAULTS, Fault

MESH = parse_mesh("fsdp=8")
TOPOLOGY = parse_mesh("4x8x8")


def run_check(fault: Fault) -> None:
    family = fault.family
    config = family.config(fault.size, scan_layers=False)
    match fault.check:
        case "structure":
            check_structure(family, config)
        case "sharding":
            check_sharding(family, config, MESH, MESH.devices())
        case "sharding_topology":
            check_sharding(family, config, TOPOLOGY)
        case "init":
            check_init(family, config, MESH, MESH.devices())
        case "forward":
            check_forward(family, config, MESH, MESH.devices())
        case "train_step":
            check_train_step(family, config, MESH, MESH.devices())
        case "grad_accumulation":
            check_grad_accumulation(family, config, MESH, MESH.devices())
        case "hygiene":
            check_hygiene(family, config, MESH, MESH.devices())
        case "optimizer_sharding":
            check_optimizer_sharding(family, config, MESH)
        case _:
            raise ValueError(f"no such check {fault.check!r}")


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_fault_is_caught(fault, monkeypatch):
    if fault.patch is not None:
        monkeypatch.setattr(*fault.patch)
    with pytest.raises(CheckFailure) as caught:
        run_check(fault)
    report = str(caught.value)
    check = "sharding" if fault.check == "sharding_topology" else fault.check
    assert report.startswith(f"{fault.family.name} {check}:"), report
    for expected in fault.expect:
        assert expected in report, f"{expected!r} not in report:\n{report}"
