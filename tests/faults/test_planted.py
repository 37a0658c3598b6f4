"""Each planted fault must make its intended check fail, naming the right leaf path.

Faults run through the check registry, on the tier's primary mesh; a fault whose check
the tier leaves out (its quantization mode, its checkpoint conversion) is skipped as not
run, never counted as caught.
"""

import pytest

from conformance.checks import registry
from conformance.contract import Pair
from conformance.core.failure import CheckFailure
from conformance.core.seams import planted
from conformance.core.tpu import TpuCompile
from conformance.pytest_plugin.session import settings
from tests.faults.catalogue import FAULTS
from tests.suite_run import facets


def _tpu_compile(fault, request) -> TpuCompile | None:
    """The TPU compile a ``tpu_compile`` fault runs: the run's first ``--tpu`` target of
    its scale (skips, saying so, without one); ``None`` for any other check's fault."""
    if registry.get(fault.check).where != "tpu":
        return None
    targets = [t for t in settings(request.config).tpu if t.production == fault.production]
    if not targets:
        scale = "@production " if fault.production else ""
        pytest.skip(f"not run: no --conformance-tpu {scale}target (make test-tpu gives them)")
    return TpuCompile(targets[0], fault.size, bool(fault.scan_layers))


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_fault_is_caught(fault, monkeypatch, tmp_path, tier, primary_mesh, request):
    mesh, _ = primary_mesh
    production = fault.production and registry.get(fault.check).where == "tpu"
    found = facets(
        mesh,
        fault.quant,
        fault.params,
        costly_tpu_production=production,
        dtype=fault.dtype,
        pair=fault.pair,
    )
    if reason := tier.leaves_out(fault.family, found):
        pytest.skip(f"not run: tier {tier.name} leaves out {fault.check} with {reason}")
    tpu = _tpu_compile(fault, request)
    if tpu is not None:
        mesh = tpu.target.mesh
    if short := [a for a in fault.mesh_axes if mesh.sizes().get(a, 1) < 2]:
        pytest.skip(f"not run: the fault shows only with mesh axes {short} of size 2 or more")
    if fault.model_patch is not None:
        monkeypatch.setattr(*fault.model_patch)
    with planted(**fault.seams), pytest.raises(CheckFailure) as caught:
        fault.run(tmp_path, mesh, tpu)
    report = str(caught.value)
    assert report.startswith(f"{fault.family.name} {fault.check}:"), report
    for expected in fault.expect:
        assert expected in report, f"{expected!r} not in report:\n{report}"


def test_every_registered_check_has_a_planted_fault():
    """A check that cannot fail is a defect: every check in the registry is proven by one."""
    missing = sorted(set(registry.BUILTIN) - {fault.check for fault in FAULTS})
    assert not missing, f"checks without a planted fault: {', '.join(missing)}"


def test_every_mode_pair_of_a_check_has_a_planted_fault():
    """A check run on a mode pair (the ``pair`` axis) is proven on each pair by its own fault.

    A check placing nothing on devices runs no pair whose sides need them.
    """
    paired = [c for c in registry.checks().values() if registry.Axis.PAIR in c.axes]
    assert paired, "no check runs on the pair axis"
    planted = {(fault.check, fault.pair) for fault in FAULTS}
    missing = [
        f"{check.name}[{pair.id}]"
        for check in paired
        for pair in Pair
        if (check.devices or not pair.on_devices) and (check.name, pair) not in planted
    ]
    assert not missing, f"mode pairs without a planted fault: {', '.join(missing)}"
