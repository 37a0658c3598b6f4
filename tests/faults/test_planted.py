"""Each planted fault must make its intended check fail, naming the right leaf path.

Faults run on the tier's primary mesh; a fault whose check the tier leaves out (its
quantization mode, its checkpoint conversion) is skipped as not run, never counted as
caught.
"""

from pathlib import Path

import pytest

from conformance import families
from conformance.aqt_checks import (
    check_aqt_convert,
    check_aqt_forward,
    check_aqt_layout,
    check_aqt_serve,
    check_aqt_train_step,
)
from conformance.checkpoint_checks import check_checkpoint_conversion, restore_checked
from conformance.checks import (
    CheckFailure,
    check_forward,
    check_init,
    check_sharding,
    check_structure,
)
from conformance.core.sharding import MeshSpec, parse_mesh
from conformance.decode_checks import check_decode, check_decode_cache, check_decode_consistency
from conformance.invariance_checks import BACKENDS, check_sharding_invariance
from conformance.quant_checks import (
    check_quant_checkpoint,
    check_quant_forward,
    check_quant_hygiene,
    check_quant_params,
)
from conformance.runtime.checkpoints import CheckpointInfo, expected_layout, save
from conformance.runtime.training import flat_state, nnx_trainer
from conformance.state_checks import check_state_hygiene
from conformance.tiling_checks import check_vocab_tiling
from conformance.train_checks import (
    check_fp8_train_step,
    check_grad_accumulation,
    check_hygiene,
    check_optimizer_sharding,
    check_train_step,
)
from tests.faults.catalogue import FAULTS, Fault

TOPOLOGY = parse_mesh("4x8x8")


def run_check(fault: Fault, workdir: Path, mesh: MeshSpec) -> None:
    family = fault.family
    config = family.config(fault.size, scan_layers=False)
    devices = mesh.devices()
    match fault.check:
        case "checkpoint_conversion":
            source_scan, target_scan = fault.layouts
            info = CheckpointInfo(family.name, fault.size, "linen", source_scan)
            check_checkpoint_conversion(family, info, target_scan, mesh, devices, workdir)
        case "restore":
            real = families.get(family.name)
            trainer = nnx_trainer(real, config)
            state = flat_state(trainer.initial_state(trainer.runner.init(0)))
            save(workdir / "real", state, CheckpointInfo(real.name, fault.size, "nnx", False))
            layout = expected_layout(family, config, "nnx")
            restore_checked(family, "checkpoint_roundtrip", workdir / "real", layout, None)
        case "structure":
            check_structure(family, config)
        case "sharding":
            check_sharding(family, config, mesh, devices)
        case "sharding_topology":
            check_sharding(family, config, TOPOLOGY)
        case "init":
            check_init(family, config, mesh, devices)
        case "forward":
            check_forward(family, config, mesh, devices)
        case "sharding_invariance":
            for backend in BACKENDS:
                check_sharding_invariance(family, config, mesh, devices, backend)
        case "train_step":
            check_train_step(family, config, mesh, devices)
        case "grad_accumulation":
            check_grad_accumulation(family, config, mesh, devices)
        case "vocab_tiling":
            check_vocab_tiling(family, config, mesh, devices)
        case "fp8_train_step":
            check_fp8_train_step(family, config, mesh, devices)
        case "hygiene":
            check_hygiene(family, config, mesh, devices)
        case "state_hygiene":
            check_state_hygiene(family, config, workdir, scan_layers=False)
        case "decode_cache":
            check_decode_cache(family, config, mesh, devices)
        case "decode_consistency":
            check_decode_consistency(family, config, mesh, devices)
        case "decode":
            check_decode(family, config, mesh, devices)
        case "quant_params":
            check_quant_params(family, config, mesh, fault.quant)
        case "quant_forward":
            check_quant_forward(family, config, mesh, devices, fault.quant)
        case "quant_hygiene":
            check_quant_hygiene(family, config, mesh, fault.quant)
        case "quant_checkpoint":
            check_quant_checkpoint(
                family, config, mesh, devices, fault.quant, workdir, scan_layers=False
            )
        case "aqt_forward":
            check_aqt_forward(family, config, mesh, devices)
        case "aqt_train_step":
            check_aqt_train_step(family, config, mesh, devices)
        case "aqt_layout":
            check_aqt_layout(family, config, mesh)
        case "aqt_convert":
            check_aqt_convert(family, config, mesh, devices)
        case "aqt_serve":
            check_aqt_serve(family, config, mesh, devices, workdir, scan_layers=False)
        case "optimizer_sharding":
            check_optimizer_sharding(family, config, mesh)
        case _:
            raise ValueError(f"no such check {fault.check!r}")


def _case(fault: Fault, mesh: MeshSpec) -> dict[str, object]:
    """The suite parameters of the test that would run ``fault``'s check."""
    source, target = ("scan" if scan else "loop" for scan in fault.layouts)
    return {
        "mesh": mesh,
        "scan_layers": False,
        "quant": fault.quant,
        "layouts": f"{source}-{target}",
    }


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_fault_is_caught(fault, monkeypatch, tmp_path, tier, primary_mesh):
    mesh, _ = primary_mesh
    if reason := tier.leaves_out(fault.family, _case(fault, mesh), "f32"):
        pytest.skip(f"not run: tier {tier.name} leaves out {fault.check} with {reason}")
    if short := [a for a in fault.mesh_axes if mesh.sizes().get(a, 1) < 2]:
        pytest.skip(f"not run: the fault shows only with mesh axes {short} of size 2 or more")
    if fault.patch is not None:
        monkeypatch.setattr(*fault.patch)
    with pytest.raises(CheckFailure) as caught:
        run_check(fault, tmp_path, mesh)
    report = str(caught.value)
    check = {
        "sharding_topology": "sharding",
        "restore": "checkpoint_roundtrip",
        "decode_cache": "decode_cache",
    }.get(fault.check, fault.check)
    assert report.startswith(f"{fault.family.name} {check}:"), report
    for expected in fault.expect:
        assert expected in report, f"{expected!r} not in report:\n{report}"
