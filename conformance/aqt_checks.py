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
from pathlib import Path
from typing import Any

import jax
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
    shardings_for,
)
from conformance.contract import Family
from conformance.core.numerics import EXACT, compare_arrays, compare_trees, report
from conformance.core.records import emit_verdict, failed
from conformance.core.sharding import MeshSpec
from conformance.core.trees import PathMapError, map_paths, structure_diff
from conformance.quant_checks import check_error_bound, float_params
from conformance.runtime import checkpoints
from conformance.runtime.aqt import COLLECTION, AqtError, LinenAqt, NnxAqt, linen_aqt, nnx_aqt
from conformance.runtime.backends import linen_runner, nnx_runner
from conformance.train_checks import check_train_step

AQT_MAX_ERROR = 0.06
"""Bound on the relative L2 error of AQT int8 logits against float logits."""

_FROZEN = re.compile(r"^(?P<owner>.*)/[^/]+/qrhs/frozen/")
"""A frozen kernel's path: aqtp's ``qrhs/frozen`` under the dot-general submodule (whatever
the family names it) of the layer that owns the float kernel."""


def aqt_sides(family: Family, check: str, config: Any) -> tuple[LinenAqt, NnxAqt, dict[str, str]]:
    """Both sides in AQT convert/serve modes, and ``{Linen path: NNX path}`` of frozen leaves."""
    try:
        linen, nnx_ = linen_aqt(family, config), nnx_aqt(family, config)
        mapping = map_paths(family.path_rules(config), linen.specs)
    except (AqtError, PathMapError) as err:
        fail(family, check, str(err))
    return linen, nnx_, mapping


def check_aqt_forward(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """TRAIN-mode forwards agree across backends, each within :data:`AQT_MAX_ERROR` of float."""
    config = family.with_mesh(config, devices)
    check = "aqt_forward"
    train = family.aqt_config(config, "train")
    linen_params, nnx_params = float_params(family, check, config, mesh, devices)
    linen, nnx_ = linen_runner(family, train), nnx_runner(family, train)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    reference = linen_runner(family, config).forward(linen_params, batch)[0]
    linen_logits = linen.forward(linen_params, batch)[0]
    nnx_logits = nnx_.forward(nnx_params, batch)[0]
    found = compare_arrays("logits", linen_logits, nnx_logits)
    title = f"AQT int8 TRAIN forward on mesh {mesh.id} (index: batch, position, vocab)"
    emit_verdict(title, "logits", linen_logits, nnx_logits, found)
    if found is not None:
        moved = forward_attribution(
            family,
            train,
            mesh,
            (linen_logits, nnx_logits),
            (linen_params, nnx_params),
            quantized=True,
        )
        fail(family, check, report(title, [found], ("Linen", "NNX")) + f"\n  {moved}")
    for side, logits in (("Linen", linen_logits), ("NNX", nnx_logits)):
        where = f"{side} AQT int8 TRAIN on mesh {mesh.id}"
        check_error_bound(family, check, where, logits, reference, AQT_MAX_ERROR)


def check_aqt_train_step(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """TRAIN-mode train steps agree across backends (loss, gradients, whole state)."""
    config = family.with_mesh(config, devices)
    train = family.aqt_config(config, "train")
    check_train_step(family, train, mesh, devices, check="aqt_train_step")


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


def check_aqt_layout(family: Family, config: Any, mesh: MeshSpec) -> dict[str, Any]:
    """The frozen kernels and serve parameters have one layout across backends.

    Frozen leaves (``qvalue`` int8, ``scale``) agree in paths, shapes, dtypes and specs,
    each carries a logical name per dimension, and the serve parameters are the float
    ones less exactly the frozen kernels. Returns the golden payload.
    """
    check = "aqt_layout"
    linen, nnx_, mapping = aqt_sides(family, check, config)
    problems = structure_diff(linen.specs, nnx_.specs, mapping)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(
        family, check, f"frozen kernels: {len(problems)} difference(s) ({counts})", problems
    )
    qvalues = {p: s for p, s in nnx_.specs.items() if p.endswith("/qvalue")}
    if not qvalues:
        fail(family, check, "no frozen qvalue leaf: AQT quantized nothing")
    wrong = [f"{p}: {s.dtype}" for p, s in sorted(qvalues.items()) if s.dtype != "int8"]
    fail_if_any(family, check, "frozen qvalue leaves not int8", wrong)
    unnamed = [
        f"{side} {path}: logical names {names} for a {len(spec.shape)}-dim leaf {spec}"
        for side, aqt in (("Linen", linen), ("NNX", nnx_))
        for path, spec in sorted(aqt.specs.items())
        if (names := aqt.logical[path]) is None or len(names) != len(spec.shape)
    ]
    fail_if_any(family, check, "frozen leaves whose sharding cannot be resolved", unnamed)
    problems = []
    for side, aqt, float_runner in (
        ("Linen", linen, linen_runner(family, config)),
        ("NNX", nnx_, nnx_runner(family, config)),
    ):
        serve_paths = set(aqt.serve_runner.specs)
        problems += _kernel_less(side, set(float_runner.specs), serve_paths, set(aqt.specs))
    fail_if_any(
        family, check, "serve parameters are not the float ones less the frozen kernels", problems
    )
    rules = family.axis_rules(config)
    _, nnx_specs = agreed_specs(family, check, linen, nnx_, mapping, mesh, rules)
    serve = nnx_.serve_runner
    serve_map = param_map(family, check, family.aqt_config(config, "serve"))
    _, serve_specs = agreed_specs(family, check, linen.serve_runner, serve, serve_map, mesh, rules)

    return {
        "mesh": dict(mesh.axes),
        COLLECTION: leaf_table(nnx_.specs, nnx_specs),
        "serve_params": leaf_table(serve.specs, serve_specs),
    }


def check_aqt_convert(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """CONVERT freezes the same kernels on both backends and leaves each forward unchanged.

    From the same float parameters: every ``qvalue`` equal and every ``scale`` within the
    float policy across backends, and on each side the convert-mode logits equal the
    TRAIN-mode logits exactly (converting must not change what the model computes).
    """
    config = family.with_mesh(config, devices)
    check = "aqt_convert"
    linen, nnx_, mapping = aqt_sides(family, check, config)
    train = family.aqt_config(config, "train")
    linen_params, nnx_params = float_params(family, check, config, mesh, devices)
    nnx_train = nnx_runner(family, train)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    linen_logits, linen_frozen = linen.convert(linen_params, batch)
    nnx_logits, nnx_frozen = nnx_.convert(nnx_params, batch)
    moved = {mapping[p]: v for p, v in linen_frozen.items()}
    mismatches = compare_trees(moved, nnx_frozen)
    if mismatches:
        title = f"frozen kernels (qvalue, scale) after CONVERT on mesh {mesh.id}"
        fail(family, check, failed(title, mismatches, ("Linen", "NNX")))
    for side, logits, trained in (
        ("Linen", linen_logits, linen_runner(family, train).forward(linen_params, batch)[0]),
        ("NNX", nnx_logits, nnx_train.forward(nnx_params, batch)[0]),
    ):
        found = compare_arrays("logits", trained, logits, EXACT)
        if found is not None:
            title = f"{side} CONVERT forward vs TRAIN forward on mesh {mesh.id}"
            fail(family, check, failed(title, [found], ("TRAIN", "CONVERT")))


def check_aqt_serve(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, workdir: Path, *, scan_layers: bool
) -> None:
    """A converted serve tree survives orbax, and SERVE from it equals CONVERT, per backend.

    ``config``'s layer layout is ``scan_layers`` (recorded with the checkpoint).

    Each side converts its own sharded float init, saves the serve tree (kernel-less
    parameters and frozen kernels, the latter placed as CONVERT made them), restores it
    strictly into the serve-mode model's layout: every leaf (each ``qvalue`` byte) must
    come back exact, and the SERVE logits from the restored tree must equal the CONVERT
    logits exactly.
    """
    config = family.with_mesh(config, devices)
    check = "aqt_serve"
    linen, nnx_, _ = aqt_sides(family, check, config)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    for side, aqt in (("Linen", linen), ("NNX", nnx_)):
        convert, serve = aqt.convert_runner, aqt.serve_runner
        params = convert.init(0, shardings_for(family, check, convert.logical, mesh, devices))
        serve_shardings = shardings_for(family, check, serve.logical, mesh, devices)
        logits, frozen = aqt.convert(params, batch)
        tree = {f"params/{p}": jax.device_put(params[p], s) for p, s in serve_shardings.items()}
        tree |= {f"{COLLECTION}/{p}": v for p, v in frozen.items()}
        layout = {f"params/{p}": s for p, s in serve.specs.items()}
        layout |= {f"{COLLECTION}/{p}": s for p, s in aqt.specs.items()}
        info = checkpoints.CheckpointInfo(
            family.name, family.device_size, side.lower(), scan_layers
        )
        directory = workdir / f"{side.lower()}-aqt-serve"
        checkpoints.save(directory, tree, info)
        try:
            restored = checkpoints.restore(
                directory, layout, {p: v.sharding for p, v in tree.items()}
            )
        except checkpoints.CheckpointError as err:
            fail(family, check, f"{side}: {err}")
        mismatches = compare_trees(tree, restored, EXACT)
        if mismatches:
            title = f"{side} AQT serve tree after an orbax round trip"
            fail(family, check, failed(title, mismatches, ("saved", "restored")))
        prefix = f"{COLLECTION}/"
        served = aqt.serve(
            {p.removeprefix("params/"): v for p, v in restored.items() if p.startswith("params/")},
            {p.removeprefix(prefix): v for p, v in restored.items() if p.startswith(prefix)},
            batch,
        )
        found = compare_arrays("logits", logits, served, EXACT)
        if found is not None:
            title = (
                f"{side} SERVE forward from the restored tree vs CONVERT forward on mesh {mesh.id}"
            )
            fail(family, check, failed(title, [found], ("CONVERT", "SERVE")))
