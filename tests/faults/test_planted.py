"""Each planted fault must make its intended check fail, naming the right leaf path.

Faults run through the check registry, on the tier's primary mesh; a fault whose check
the tier leaves out (its quantization mode, its checkpoint conversion) is skipped as not
run, never counted as caught.
"""

from pathlib import Path

import jax.numpy as jnp
import pytest

from conformance.checks import registry
from conformance.core.failure import CheckFailure
from conformance.core.seams import planted
from conformance.core.sharding import MeshSpec, parse_mesh
from tests.faults.catalogue import FAULTS, Fault

TOPOLOGY = parse_mesh("4x8x8")


def run_check(fault: Fault, workdir: Path, mesh: MeshSpec) -> None:
    """Run ``fault``'s check as the suite would, on ``mesh`` (or its scenario instead)."""
    if fault.scenario is not None:
        fault.scenario(fault, workdir)
        return
    check = registry.get(fault.check)
    values = {
        "family": fault.family,
        "size": fault.size,
        "scan_layers": fault.params.get("layouts", (False,))[0],
        "dtype": jnp.float32,
        "quant": fault.quant,
        "mesh": mesh,
        "topology": TOPOLOGY,
    }
    target = registry.mesh_of(check, values, mesh)
    devices = target.devices() if check.devices and target is not None else None
    case = registry.case_of(check, values, target, devices)
    params = dict(fault.params)
    if check.workdir:
        params["workdir"] = workdir
    if check.saved_on:
        params["saved_on"] = case.on(mesh)
    check(case, **params)


def _facets(fault: Fault, mesh: MeshSpec) -> dict[str, object]:
    """What a tier narrows the test that would run ``fault``'s check by."""
    source, target = ("scan" if scan else "loop" for scan in fault.params.get("layouts", (0, 0)))
    facets = {"mesh": mesh, "scan_layers": False, "dtype": "f32", "layouts": f"{source}-{target}"}
    return facets | ({"quant": fault.quant} if fault.quant else {})


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_fault_is_caught(fault, monkeypatch, tmp_path, tier, primary_mesh):
    mesh, _ = primary_mesh
    if reason := tier.leaves_out(fault.family, _facets(fault, mesh)):
        pytest.skip(f"not run: tier {tier.name} leaves out {fault.check} with {reason}")
    if short := [a for a in fault.mesh_axes if mesh.sizes().get(a, 1) < 2]:
        pytest.skip(f"not run: the fault shows only with mesh axes {short} of size 2 or more")
    if fault.model_patch is not None:
        monkeypatch.setattr(*fault.model_patch)
    with planted(**fault.seams), pytest.raises(CheckFailure) as caught:
        run_check(fault, tmp_path, mesh)
    report = str(caught.value)
    assert report.startswith(f"{fault.family.name} {fault.check}:"), report
    for expected in fault.expect:
        assert expected in report, f"{expected!r} not in report:\n{report}"
