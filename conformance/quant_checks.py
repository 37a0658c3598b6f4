"""Quantization checks: Qwix QAT and PTQ, int8 and fp8, on both backends.

Both sides quantize the same float parameters (Linen's, transplanted to NNX), each the
way a user of that backend would: Linen through ``qwix.quantize_params`` on the
abstract quantized tree, NNX through ``qwix.quantize_model`` on the float model. The
quantized layouts must agree leaf for leaf, the quantized forwards must agree under the
tolerance policy, and each must differ from the float forward by more than zero and by
no more than the mode's stated bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from conformance.checks import (
    BATCH_SIZE,
    agreed_specs,
    fail,
    fail_if_any,
    forward_attribution,
    leaf_table,
    param_map,
    place_batch,
    resolve_all,
    shardings_for,
)
from conformance.contract import Family
from conformance.core.distributed import host_array
from conformance.core.numerics import EXACT, compare_arrays, compare_trees, report
from conformance.core.records import emit_verdict, failed
from conformance.core.sharding import MeshSpec
from conformance.core.trees import (
    Flat,
    PathMapError,
    flatten_state,
    map_paths,
    structure_diff,
    variable_kind,
)
from conformance.runtime import checkpoints
from conformance.runtime.backends import (
    LinenRunner,
    NnxRunner,
    linen_runner,
    nnx_runner,
    transplant,
)
from conformance.runtime.quant import MODES, unused_rules


def quantized_runners(
    family: Family, check: str, config: Any, quant: str
) -> tuple[LinenRunner, NnxRunner, dict[str, str]]:
    """Both sides quantized with ``quant``, and ``{Linen path: NNX path}`` of their params.

    Fails if a quantization rule matched no operation on either side.
    """
    linen, nnx_ = linen_runner(family, config, quant), nnx_runner(family, config, quant)
    for side, runner in (("Linen", linen), ("NNX", nnx_)):
        if runner.provider is not None:
            fail_if_any(
                family, check, f"{side} {quant}: a rule is a no-op", unused_rules(runner.provider)
            )
    try:
        mapping = map_paths(family.path_rules(config), linen.specs)
    except PathMapError as err:
        fail(family, check, str(err))
    return linen, nnx_, mapping


def check_quant_params(family: Family, config: Any, mesh: MeshSpec, quant: str) -> dict[str, Any]:
    """The quantized parameter trees agree across backends in paths, shapes, dtypes and specs.

    For PTQ, kernels must have become ``qvalue`` leaves of the mode's type. Returns the
    golden payload.
    """
    check, mode = "quant_params", MODES[quant]
    linen, nnx_, mapping = quantized_runners(family, check, config, quant)
    problems = structure_diff(linen.specs, nnx_.specs, mapping)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(family, check, f"{quant}: {len(problems)} difference(s) ({counts})", problems)
    if mode.method == "ptq":
        qvalues = [p for p, s in nnx_.specs.items() if p.endswith("/qvalue")]
        wrong = [
            f"{p}: {nnx_.specs[p].dtype}" for p in qvalues if nnx_.specs[p].dtype != mode.qtype
        ]
        if not qvalues:
            fail(family, check, f"{quant}: no parameter was quantized (no qvalue leaf)")
        fail_if_any(family, check, f"{quant}: qvalue leaves not of type {mode.qtype}", wrong)
    _, nnx_specs = agreed_specs(
        family, check, linen, nnx_, mapping, mesh, family.axis_rules(config)
    )
    return {
        "mode": quant,
        "mesh": dict(mesh.axes),
        "leaf_count": len(nnx_.specs),
        "leaves": leaf_table(nnx_.specs, nnx_specs),
    }


def check_error_bound(
    family: Family, check: str, where: str, quantized: Any, reference: Any, bound: float
) -> None:
    """Quantized logits differ from float ``reference`` logits, by at most ``bound``.

    The measure is the relative L2 error ``||quantized - reference|| / ||reference||``;
    an error of exactly zero fails, as it means quantization did nothing.
    """
    q, r = (host_array(x).astype(np.float64) for x in (quantized, reference))
    error = float(np.linalg.norm(q - r) / max(np.linalg.norm(r), np.finfo(np.float64).tiny))
    if error == 0.0:
        fail(
            family,
            check,
            f"{where}: quantized logits equal the float logits exactly; quantization did nothing",
        )
    if not error <= bound:
        fail(
            family,
            check,
            f"{where}: relative L2 error of quantized vs float logits is {error:.4g}, "
            f"above the bound {bound}",
        )


def float_params(
    family: Family, check: str, config: Any, mesh: MeshSpec, devices: Mesh
) -> tuple[Flat, Flat]:
    """Linen's float parameters from its sharded init, and the same values on NNX's paths."""
    config = family.with_mesh(config, devices)
    linen_float, nnx_float = linen_runner(family, config), nnx_runner(family, config)
    float_map = param_map(family, check, config)
    linen_sh = shardings_for(family, check, linen_float.logical, mesh, devices)
    linen_params = linen_float.init(0, linen_sh)
    nnx_shardings = shardings_for(family, check, nnx_float.logical, mesh, devices)
    return linen_params, transplant(linen_params, float_map, nnx_float.specs, nnx_shardings)


def quantized_params(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, quant: str
) -> tuple[Flat, Flat, Flat, Flat]:
    """``(Linen float, NNX float, Linen quantized, NNX quantized)`` parameters on the mesh.

    NNX's float parameters are Linen's, transplanted; each side then quantizes its own.
    """
    config = family.with_mesh(config, devices)
    check = "quant_forward"
    linen, nnx_, _ = quantized_runners(family, check, config, quant)
    linen_params, nnx_params = float_params(family, check, config, mesh, devices)
    return linen_params, nnx_params, linen.quantize(linen_params), nnx_.quantize(nnx_params)


def check_quant_forward(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, quant: str
) -> None:
    """Linen and NNX quantized forwards agree, and each stays within the mode's error bound.

    For PTQ, the quantized parameters themselves must agree first: every ``qvalue``
    exactly, every ``scale`` under the float policy.
    """
    config = family.with_mesh(config, devices)
    check, mode = "quant_forward", MODES[quant]
    linen, nnx_, mapping = quantized_runners(family, check, config, quant)
    linen_float, _, linen_q, nnx_q = quantized_params(family, config, mesh, devices, quant)
    if mode.method == "ptq":
        moved = {mapping[p]: v for p, v in linen_q.items()}
        mismatches = compare_trees(moved, nnx_q)
        if mismatches:
            title = f"{quant} quantized parameters on mesh {mesh.id}"
            fail(family, check, failed(title, mismatches, ("Linen", "NNX")))
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    reference = host_array(linen_runner(family, config).forward(linen_float, batch)[0])
    linen_logits = host_array(linen.forward(linen_q, batch)[0])
    nnx_logits = host_array(nnx_.forward(nnx_q, batch)[0])
    found = compare_arrays("logits", linen_logits, nnx_logits)
    title = f"{quant} forward on mesh {mesh.id} (index: batch, position, vocab)"
    emit_verdict(title, "logits", linen_logits, nnx_logits, found)
    if found is not None:
        moved = forward_attribution(
            family, config, mesh, (linen_logits, nnx_logits), (linen_q, nnx_q), quant
        )
        fail(family, check, report(title, [found], ("Linen", "NNX")) + f"\n  {moved}")
    for side, logits in (("Linen", linen_logits), ("NNX", nnx_logits)):
        where = f"{side} {quant} on mesh {mesh.id}"
        check_error_bound(family, check, where, logits, reference, mode.max_error)


def _nnx_transients(model: nnx.Module, allowed: set[type]) -> list[str]:
    """Variables of ``model`` whose type the float model does not have, with the type."""
    return [
        f"{path}: {variable_kind(var)} appeared with quantization"
        for path, var in flatten_state(nnx.state(model)).items()
        if type(var) not in allowed
    ]


def check_quant_hygiene(family: Family, config: Any, mesh: MeshSpec, quant: str) -> None:
    """Quantizing leaves nothing transient behind, and every leaf has a sharding.

    NNX: the quantized model holds only Variable types the float model holds (the
    tracing forward Qwix runs must not leave ``nnx.Intermediate`` or other sown values).
    Linen: ``init`` of the quantized module returns only the float module's collections.
    Both: the parameter tree and its sharding tree have equal leaf counts.
    """
    check = "quant_hygiene"
    linen, nnx_, _ = quantized_runners(family, check, config, quant)
    float_model = nnx.eval_shape(lambda: nnx_runner(family, config).build(0))
    allowed = {type(v) for v in flatten_state(nnx.state(float_model)).values()}
    quantized_model = nnx.eval_shape(lambda: nnx_.build(0))
    fail_if_any(
        family,
        check,
        f"NNX {quant}: quantization left transient state in the model",
        _nnx_transients(quantized_model, allowed),
    )
    example = family.batch(config, 1)
    inputs = (example.tokens, example.positions, example.segment_ids)
    float_module = linen_runner(family, config).module
    expected = set(jax.eval_shape(float_module.init, jax.random.key(0), *inputs))
    found = set(jax.eval_shape(linen.module.init, jax.random.key(0), *inputs))
    extra = [f"collection {name!r} appeared with quantization" for name in sorted(found - expected)]
    fail_if_any(family, check, f"Linen {quant}: init returns transient collections", extra)
    leaves = {
        "Linen": len(
            jax.tree.leaves(jax.eval_shape(linen.module.init, jax.random.key(0), *inputs)["params"])
        ),
        "NNX": len(jax.tree.leaves(nnx.state(quantized_model, nnx.Param))),
    }
    for side, runner in (("Linen", linen), ("NNX", nnx_)):
        n_specs = len(resolve_all(family, check, runner.logical, mesh, family.axis_rules(config)))
        if leaves[side] != n_specs:
            fail(
                family,
                check,
                f"{side} {quant}: the parameter tree has {leaves[side]} leaves but its "
                f"sharding tree has {n_specs}",
            )


def check_quant_checkpoint(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    quant: str,
    workdir: Path,
    *,
    scan_layers: bool,
) -> None:
    """Quantized parameters survive an orbax save and a strict restore, on each backend.

    Each side saves the quantized parameters of its own sharded init (``config``, whose
    layer layout is ``scan_layers``).

    Every leaf (``qvalue`` bytes, scales, float leaves) must come back byte-exact with
    its dtype, and the restored model's forward must equal the saved model's exactly.
    """
    config = family.with_mesh(config, devices)
    check = "quant_checkpoint"
    linen, nnx_, _ = quantized_runners(family, check, config, quant)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    for side, runner in (("Linen", linen), ("NNX", nnx_)):
        params = runner.init(0, shardings_for(family, check, runner.logical, mesh, devices))
        info = checkpoints.CheckpointInfo(
            family.name, family.device_size, side.lower(), scan_layers
        )
        directory = workdir / f"{side.lower()}-{quant}"
        checkpoints.save(directory, params, info)
        shardings = {path: value.sharding for path, value in params.items()}
        try:
            restored = checkpoints.restore(directory, runner.specs, shardings)
        except checkpoints.CheckpointError as err:
            fail(family, check, f"{side} {quant}: {err}")
        mismatches = compare_trees(params, restored, EXACT)
        if mismatches:
            title = f"{side} {quant} parameters after an orbax round trip"
            fail(family, check, failed(title, mismatches, ("saved", "restored")))
        found = compare_arrays(
            "logits", runner.forward(params, batch)[0], runner.forward(restored, batch)[0], EXACT
        )
        if found is not None:
            title = f"{side} {quant} forward after an orbax round trip"
            fail(family, check, failed(title, [found], ("saved", "restored")))
