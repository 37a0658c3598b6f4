"""AQT (aqtp) int8 checks: TRAIN parity, CONVERT to frozen kernels, SERVE from a checkpoint.

Both backends start from the same float parameters (Linen's, transplanted to NNX). In
TRAIN mode their fake-quantized forwards must agree and stay within
:data:`AQT_MAX_ERROR` of float. CONVERT must freeze the same ``qvalue`` and ``scale``
on both sides, into a layout with sharding goldens, and leave the forward unchanged.
SERVE must run from a saved and restored serve tree, without float kernels, and give
the convert forward exactly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import (
    Rerun,
    agreed_specs,
    error_bound,
    forward_attribution,
    leaf_table,
    paired,
    quantized_forwards,
    rerun_note,
    round_trip,
    shared_params,
    train_step_parity,
)
from conformance.contract import Aqt, required
from conformance.core.failure import KnownFailure, fail, fail_if_any
from conformance.core.numerics import EXACT, compare_arrays, compare_trees
from conformance.core.records import failed
from conformance.core.trees import PathMapError, map_paths, structure_diff
from conformance.runtime.aqt import COLLECTION, AqtError, AqtModel, known_failure
from conformance.runtime.case import Case
from conformance.runtime.sides import Side, live_pair

AQT_MAX_ERROR = 0.06
"""Bound on the relative L2 error of AQT int8 logits against float logits."""

_FROZEN = re.compile(r"^(?P<owner>.*)/[^/]+/qrhs/frozen/")
"""A frozen kernel's path: aqtp's ``qrhs/frozen`` under the dot-general submodule (whatever
the family names it) of the layer that owns the float kernel."""


def _train(case: Case) -> Case:
    """``case`` with the family's AQT TRAIN-mode config (fake-quantized float kernels)."""
    return case.with_config(required(case.family, Aqt).config(case.config, "train"))


def aqt_pair(case: Case) -> tuple[AqtModel, AqtModel, dict[str, str]]:
    """Both sides in AQT convert/serve modes, and ``{Linen path: NNX path}`` of frozen leaves."""
    linen, nnx_ = live_pair(case)
    try:
        a, b = linen.aqt(), nnx_.aqt()
        mapping = map_paths(case.family.path_rules(case.bound), a.specs)
    except (AqtError, PathMapError) as err:
        fail(str(err))
    return a, b, mapping


def _known_failure(values: Mapping[str, Any]) -> KnownFailure | None:
    return known_failure("aqt_layout", values["scan_layers"])


@declare(ON_MESH, variant=True, capability="aqt")
def check_aqt_forward(case: Case) -> None:
    """TRAIN-mode forwards agree across backends, each within :data:`AQT_MAX_ERROR` of float.

    Quantization-aware (:func:`~conformance.checks.kernel.quantized_forwards`): logits
    that differ by float rounding carried across quantization steps pass.
    """
    linen_params, nnx_params = shared_params(*live_pair(case))
    linen, nnx_ = live_pair(_train(case))
    batch = case.batch()
    float_logits = (
        linen.on(case).forward(linen_params, batch)[0],
        nnx_.on(case).forward(nnx_params, batch)[0],
    )
    linen_logits = linen.forward(linen_params, batch)[0]
    nnx_logits = nnx_.forward(nnx_params, batch)[0]

    def rerun(side: Side) -> Rerun:
        return lambda nudged: side.forward(side.place(nudged), batch)[0]

    title = f"AQT int8 TRAIN forward on mesh {case.mesh.id} (index: batch, position, vocab)"
    message = quantized_forwards(
        title,
        (linen.name, nnx_.name),
        (linen_logits, nnx_logits),
        float_logits,
        (rerun(linen), rerun(nnx_)),
        (linen_params, nnx_params),
        lambda: forward_attribution(
            linen,
            nnx_,
            (linen_logits, nnx_logits),
            (linen_params, nnx_params),
            quantized=True,
        ),
    )
    if message is not None:
        fail(message)
    for side, logits, reference in zip(
        (linen, nnx_), (linen_logits, nnx_logits), float_logits, strict=True
    ):
        where = f"{side.name} AQT int8 TRAIN on mesh {case.mesh.id}"
        error_bound(where, logits, reference, AQT_MAX_ERROR)


@declare(ON_MESH, variant=True, capability="aqt")
def check_aqt_train_step(case: Case) -> None:
    """TRAIN-mode train steps agree across backends (loss, gradients, whole state).

    Quantization-aware, against the float steps of the same case
    (:func:`~conformance.checks.kernel.train_step_parity`).
    """
    train_step_parity(_train(case), "aqt_train_step", case)


def _kernel_less(
    side: str, float_paths: set[str], serve_paths: set[str], frozen: set[str]
) -> list[str]:
    """Why the serve parameters are not the float ones less exactly the frozen kernels."""
    owners = {m.group("owner") for p in frozen if (m := _FROZEN.match(p))}
    dropped = float_paths - serve_paths
    problems = [
        f"{side} {p}: in the serve tree but not a float parameter"
        for p in sorted(serve_paths - float_paths)
    ]
    problems += [
        f"{side} {p}: dropped from the serve tree but no frozen kernel replaces it"
        for p in sorted(dropped)
        if p.rsplit("/", 1)[0] not in owners
    ]
    problems += [
        f"{side} {owner}/kernel: frozen, yet the float kernel is still a serve parameter"
        for owner in sorted(owners)
        if f"{owner}/kernel" in serve_paths
    ]
    return problems


@declare(
    ON_MESH,
    devices=False,
    capability="aqt",
    golden=True,
    known_failure=_known_failure,
)
def check_aqt_layout(case: Case) -> dict[str, Any]:
    """The frozen kernels and serve parameters have one layout across backends.

    Frozen leaves (``qvalue`` int8, ``scale``) agree in paths, shapes, dtypes and specs,
    each carries a logical name per dimension, and the serve parameters are the float
    ones less exactly the frozen kernels. Returns the golden payload.
    """
    linen, nnx_, mapping = aqt_pair(case)
    problems = structure_diff(linen.specs, nnx_.specs, mapping)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(f"frozen kernels: {len(problems)} difference(s) ({counts})", problems)
    qvalues = {p: s for p, s in nnx_.specs.items() if p.endswith("/qvalue")}
    if not qvalues:
        fail("no frozen qvalue leaf: AQT quantized nothing")
    wrong = [f"{p}: {s.dtype}" for p, s in sorted(qvalues.items()) if s.dtype != "int8"]
    fail_if_any("frozen qvalue leaves not int8", wrong)
    unnamed = [
        f"{side.name} {path}: logical names {names} for a {len(spec.shape)}-dim leaf {spec}"
        for side, aqt in zip(live_pair(case), (linen, nnx_), strict=True)
        for path, spec in sorted(aqt.specs.items())
        if (names := aqt.logical[path]) is None or len(names) != len(spec.shape)
    ]
    fail_if_any("frozen leaves whose sharding cannot be resolved", unnamed)
    problems = []
    for side, aqt in zip(live_pair(case), (linen, nnx_), strict=True):
        serve_paths = set(aqt.serve_runner.specs)
        problems += _kernel_less(side.name, set(side.runner.specs), serve_paths, set(aqt.specs))
    fail_if_any("serve parameters are not the float ones less the frozen kernels", problems)
    linen_side, nnx_side = live_pair(case)
    _, nnx_specs = agreed_specs(
        (linen_side, linen.logical, linen.specs), (nnx_side, nnx_.logical, nnx_.specs), mapping
    )
    serve_config = required(case.family, Aqt).config(case.config, "serve")
    serving = live_pair(case.with_config(serve_config))
    serve = nnx_.serve_runner
    paired(*serving)
    _, serve_specs = agreed_specs(
        (
            serving[0],
            *map(serving[0].canonical, (linen.serve_runner.logical, linen.serve_runner.specs)),
        ),
        (serving[1], serve.logical, serve.specs),
    )
    return {
        "mesh": dict(case.mesh.axes),
        COLLECTION: leaf_table(nnx_.specs, nnx_specs),
        "serve_params": leaf_table(serve.specs, serve_specs),
    }


@declare(ON_MESH, variant=True, capability="aqt")
def check_aqt_convert(case: Case) -> None:
    """CONVERT freezes the same kernels on both backends and leaves each forward unchanged.

    From the same float parameters: every ``qvalue`` equal and every ``scale`` within the
    float policy across backends, and on each side the convert-mode logits equal the
    TRAIN-mode logits within the float policy (converting must not change what the model
    computes; the two are different programs, which the CPU rounds alike and a GPU not).
    """
    linen, nnx_, mapping = aqt_pair(case)
    params = shared_params(*live_pair(case))
    batch = case.batch()
    linen_logits, linen_frozen = linen.convert(params[0], batch)
    nnx_logits, nnx_frozen = nnx_.convert(params[1], batch)
    moved = {mapping[p]: v for p, v in linen_frozen.items()}
    mismatches = compare_trees(moved, nnx_frozen)
    if mismatches:
        title = f"frozen kernels (qvalue, scale) after CONVERT on mesh {case.mesh.id}"
        fail(failed(title, mismatches, tuple(side.name for side in live_pair(case))))
    for side, logits, side_params in zip(
        live_pair(_train(case)), (linen_logits, nnx_logits), params, strict=True
    ):
        found = compare_arrays("logits", side.forward(side_params, batch)[0], logits)
        if found is not None:
            title = f"{side.name} CONVERT forward vs TRAIN forward on mesh {case.mesh.id}"
            fail(failed(title, [found], ("TRAIN", "CONVERT")))


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS), where="primary", variant=True, capability="aqt", workdir=True
)
def check_aqt_serve(case: Case, workdir: Path) -> None:
    """A converted serve tree survives orbax, and SERVE from it equals CONVERT, per backend.

    Each side converts its own sharded float init, saves the serve tree (kernel-less
    parameters and frozen kernels, the latter placed as CONVERT made them), restores it
    strictly into the serve-mode model's layout: every leaf (each ``qvalue`` byte) must
    come back exact, and the SERVE logits from the restored tree must equal the CONVERT
    logits exactly. The checkpoint records the case's layer layout.
    """
    linen, nnx_, _ = aqt_pair(case)
    batch = case.batch()
    for side, aqt in zip(live_pair(case), (linen, nnx_), strict=True):
        convert, serve = aqt.convert_runner, aqt.serve_runner
        params = convert.init(0, case.shardings(convert.logical))
        serve_shardings = case.shardings(serve.logical)
        logits, frozen = aqt.convert(params, batch)
        tree = {f"params/{p}": jax.device_put(params[p], s) for p, s in serve_shardings.items()}
        tree |= {f"{COLLECTION}/{p}": v for p, v in frozen.items()}
        layout = {f"params/{p}": s for p, s in serve.specs.items()}
        layout |= {f"{COLLECTION}/{p}": s for p, s in aqt.specs.items()}
        directory = workdir / f"{side.backend}-aqt-serve"
        restored = round_trip(side, tree, layout, directory, f"{side.name} AQT serve tree")
        prefix = f"{COLLECTION}/"
        served = aqt.serve(
            {p.removeprefix("params/"): v for p, v in restored.items() if p.startswith("params/")},
            {p.removeprefix(prefix): v for p, v in restored.items() if p.startswith(prefix)},
            batch,
        )
        found = compare_arrays("logits", logits, served, EXACT)
        if found is not None:
            title = (
                f"{side.name} SERVE forward from the restored tree vs CONVERT forward on mesh "
                f"{case.mesh.id}"
            )
            fail(failed(title, [found], ("CONVERT", "SERVE")) + rerun_note())
