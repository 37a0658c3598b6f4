"""Quantization checks: Qwix QAT and PTQ, int8 and fp8, on both backends.

Both sides quantize the same float parameters (Linen's, transplanted to NNX), each the
way a user of that backend would: Linen through ``qwix.quantize_params`` on the
abstract quantized tree, NNX through ``qwix.quantize_model`` on the float model. The
quantized layouts must agree leaf for leaf, the quantized forwards must agree under the
tolerance policy, and each must differ from the float forward by more than zero and by
no more than the mode's stated bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import (
    Rerun,
    agreed_specs,
    error_bound,
    forward_attribution,
    leaf_table,
    quantized_forwards,
    round_trip,
    shared_params,
    structure_problems,
    train_step_parity,
)
from conformance.contract import Family, quantization_modes
from conformance.core.distributed import host_array
from conformance.core.failure import KnownFailure, fail, fail_if_any
from conformance.core.numerics import EXACT, Mismatch, compare_arrays, compare_trees
from conformance.core.records import failed
from conformance.core.trees import flatten_state, variable_kind
from conformance.runtime.case import Case
from conformance.runtime.quant import MODES, known_failure, unused_rules
from conformance.runtime.sides import Side, live_pair

TOPOLOGY_MODE = "qat_fp8"
"""The Qwix mode ``quant_hygiene_topology`` quantizes production sizes with (fp8, as the
large training workloads do)."""


def quantized_pair(case: Case) -> tuple[Side, Side]:
    """Both sides of the quantized case.

    Fails if a quantization rule matched no operation on either side.
    """
    linen, nnx_ = live_pair(case)
    for side in (linen, nnx_):
        if side.runner.provider is not None:
            fail_if_any(
                f"{side.name} {case.quant}: a rule is a no-op", unused_rules(side.runner.provider)
            )
    return linen, nnx_


def _known_failure(values: Mapping[str, Any]) -> KnownFailure | None:
    if values["quant"] is None:  # the family declares no mode: the test skips
        return None
    return known_failure(values["quant"], values["scan_layers"])


def _declares_topology_mode(family: Family) -> str | None:
    if TOPOLOGY_MODE in quantization_modes(family):
        return None
    return f"{family.name} does not declare {TOPOLOGY_MODE}"


@declare((*ON_MESH, Axis.QUANT), devices=False, golden=True)
def check_quant_params(case: Case) -> dict[str, Any]:
    """The quantized parameter trees agree across backends in paths, shapes, dtypes and specs.

    For PTQ, kernels must have become ``qvalue`` leaves of the mode's type. Returns the
    golden payload.
    """
    quant, mode = case.quant, MODES[case.quant]
    linen, nnx_ = quantized_pair(case)
    a, b = linen.runner, nnx_.runner
    problems = structure_problems((linen, a.specs, {}), (nnx_, b.specs, {}))
    counts = f"Linen {len(a.specs)} leaves, NNX {len(b.specs)} leaves"
    fail_if_any(f"{quant}: {len(problems)} difference(s) ({counts})", problems)
    if mode.method == "ptq":
        qvalues = [p for p, s in b.specs.items() if p.endswith("/qvalue")]
        wrong = [f"{p}: {b.specs[p].dtype}" for p in qvalues if b.specs[p].dtype != mode.qtype]
        if not qvalues:
            fail(f"{quant}: no parameter was quantized (no qvalue leaf)")
        fail_if_any(f"{quant}: qvalue leaves not of type {mode.qtype}", wrong)
    canonical = (linen, linen.canonical(a.logical), linen.canonical(a.specs))
    nnx_specs = agreed_specs(canonical, (nnx_, b.logical, b.specs))[1]
    return {
        "mode": quant,
        "mesh": dict(case.mesh.axes),
        "leaf_count": len(b.specs),
        "leaves": leaf_table(b.specs, nnx_specs),
    }


@declare((*ON_MESH, Axis.QUANT), variant=True, known_failure=_known_failure)
def check_quant_forward(case: Case) -> None:
    """Linen and NNX quantized forwards agree, and each stays within the mode's error bound.

    Both quantize the same float parameters (Linen's, transplanted to NNX). For PTQ,
    the quantized parameters themselves must agree first: every ``qvalue`` exactly,
    every ``scale`` under the float policy. The forwards are compared quantization-aware
    (:func:`~conformance.checks.kernel.quantized_forwards`): logits that differ by float
    rounding carried across quantization steps pass; a report says what the float
    forwards show.
    """
    quant, mode = case.quant, MODES[case.quant]
    linen, nnx_ = quantized_pair(case)
    linen_float, nnx_float = shared_params(*live_pair(case.quantized(None)))
    linen_q, nnx_q = linen.runner.quantize(linen_float), nnx_.runner.quantize(nnx_float)
    if mode.method == "ptq":
        mismatches = compare_trees(linen.canonical(linen_q), nnx_q)
        if mismatches:
            title = f"{quant} quantized parameters on mesh {case.mesh.id}"
            fail(failed(title, mismatches, (linen.name, nnx_.name)) + _stored_float(mismatches))
    batch = case.batch()
    floats = (linen.unquantized(), nnx_.unquantized())
    float_logits = tuple(
        host_array(side.forward(params, batch)[0])
        for side, params in zip(floats, (linen_float, nnx_float), strict=True)
    )
    linen_logits = host_array(linen.forward(linen_q, batch)[0])
    nnx_logits = host_array(nnx_.forward(nnx_q, batch)[0])

    def rerun(side: Side, float_side: Side) -> Rerun:
        return lambda nudged: side.forward(side.runner.quantize(float_side.place(nudged)), batch)[0]

    title = f"{quant} forward on mesh {case.mesh.id} (index: batch, position, vocab)"
    message = quantized_forwards(
        title,
        (linen.name, nnx_.name),
        (linen_logits, nnx_logits),
        float_logits,
        (rerun(linen, floats[0]), rerun(nnx_, floats[1])),
        (linen_float, nnx_float),
        lambda: forward_attribution(linen, nnx_, (linen_logits, nnx_logits), (linen_q, nnx_q)),
    )
    if message is not None:
        fail(message)
    for side, logits, reference in zip(
        (linen, nnx_), (linen_logits, nnx_logits), float_logits, strict=True
    ):
        where = f"{side.name} {quant} on mesh {case.mesh.id}"
        error_bound(where, logits, reference, mode.max_error)


def _stored_float(mismatches: list[Mismatch]) -> str:
    """Why kernels that one side stores as ``qvalue`` and ``scale`` stay float on the other.

    Empty when no leaf is missing that way.
    """
    one_sided = {m.path for m in mismatches if m.missing_on is not None}
    quantized = {p.rsplit("/", 2)[0] for p in one_sided if p.endswith("/qvalue")}
    float_kept = sorted(p for p in one_sided if p in quantized)
    if not float_kept:
        return ""
    return (
        f"\n  {len(float_kept)} kernel(s) stay float on one side and are stored quantized on "
        f"the other (first: {float_kept[0]}): Qwix's PTQ stores a kernel as qvalue and scale "
        "only where an intercepted operation takes the parameter itself; a kernel "
        "concatenated, reshaped or sliced before its dot_general is quantized at run time"
    )


def _nnx_transients(model: nnx.Module, allowed: set[type]) -> list[str]:
    """Variables of ``model`` whose type the float model does not have, with the type."""
    return [
        f"{path}: {variable_kind(var)} appeared with quantization"
        for path, var in flatten_state(nnx.state(model)).items()
        if type(var) not in allowed
    ]


@declare((Axis.FAMILY, Axis.SCAN_LAYERS, Axis.QUANT), where="primary", devices=False)
def check_quant_hygiene(case: Case) -> None:
    """Quantizing leaves nothing transient behind, and every leaf has a sharding.

    NNX: the quantized model holds only Variable types the float model holds (the
    tracing forward Qwix runs must not leave ``nnx.Intermediate`` or other sown values).
    Linen: ``init`` of the quantized module returns only the float module's collections.
    Both: the parameter tree and its sharding tree have equal leaf counts.
    """
    quant = case.quant
    linen, nnx_ = quantized_pair(case)
    float_model = nnx_.unquantized().runner.abstract
    allowed = {type(v) for v in flatten_state(nnx.state(float_model)).values()}
    quantized_model = nnx_.runner.abstract
    fail_if_any(
        f"NNX {quant}: quantization left transient state in the model",
        _nnx_transients(quantized_model, allowed),
    )
    expected = set(linen.unquantized().runner.abstract_variables)
    found = set(linen.runner.abstract_variables)
    extra = [f"collection {name!r} appeared with quantization" for name in sorted(found - expected)]
    fail_if_any(f"Linen {quant}: init returns transient collections", extra)
    linen_params = linen.runner.abstract_variables["params"]
    leaves = (
        len(jax.tree.leaves(linen_params)),
        len(jax.tree.leaves(nnx.state(quantized_model, nnx.Param))),
    )
    for side, count in zip((linen, nnx_), leaves, strict=True):
        n_specs = len(case.specs(side.runner.logical))
        if count != n_specs:
            fail(
                f"{side.name} {quant}: the parameter tree has {count} leaves but its "
                f"sharding tree has {n_specs}"
            )


@declare(
    (Axis.FAMILY, Axis.FULL_SIZE, Axis.TOPOLOGY),
    where="topology",
    devices=False,
    requires=_declares_topology_mode,
)
def check_quant_hygiene_topology(case: Case) -> None:
    """:func:`check_quant_hygiene` on a production size, abstractly, in :data:`TOPOLOGY_MODE`.

    A family that does not declare the mode has nothing to check (the suite skips it).
    """
    check_quant_hygiene(case.quantized(TOPOLOGY_MODE))


@declare((*ON_MESH, Axis.QUANT), variant=True, quant_method="qat")
def check_qat_train_step(case: Case) -> None:
    """Both sides train the QAT-quantized model alike for several steps (the train-step check).

    Quantization-aware: steps that differ by float rounding carried across quantization
    steps pass (:func:`~conformance.checks.kernel.train_step_parity`).
    """
    train_step_parity(case, "qat_train_step", case.quantized(None))


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS, Axis.QUANT),
    where="primary",
    variant=True,
    quant_method="ptq",
    workdir=True,
)
def check_quant_checkpoint(case: Case, workdir: Path) -> None:
    """Quantized parameters survive an orbax save and a strict restore, on each backend.

    Each side saves the quantized parameters of its own sharded init. Every leaf
    (``qvalue`` bytes, scales, float leaves) must come back byte-exact with its dtype,
    and the restored model's forward must equal the saved model's exactly.
    """
    quant = case.quant
    linen, nnx_ = quantized_pair(case)
    batch = case.batch()
    for side in (linen, nnx_):
        runner = side.runner
        params = side.init(0)
        what = f"{side.name} {quant} parameters"
        restored = round_trip(side, params, runner.specs, workdir / f"{side.backend}-{quant}", what)
        found = compare_arrays(
            "logits", runner.forward(params, batch)[0], runner.forward(restored, batch)[0], EXACT
        )
        if found is not None:
            title = f"{side.name} {quant} forward after an orbax round trip"
            fail(failed(title, [found], ("saved", "restored")))
