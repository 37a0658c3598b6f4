"""Checkpoint checks: orbax round trips and Linen <-> NNX conversion, strict and lossless.

Each check starts from a state one train step old (non-zero Adam moments, step 1), so
a conversion that drops, swaps or resets optimizer state cannot pass by accident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from conformance.checks import (
    BATCH_SIZE,
    fail,
    fail_if_any,
    misplaced,
    place_batch,
    shardings_for,
)
from conformance.contract import Family
from conformance.core.distributed import host_array
from conformance.core.numerics import EXACT, compare_arrays, compare_trees, report
from conformance.core.records import emit, listening, measure
from conformance.core.sharding import MeshSpec
from conformance.core.trees import Flat, specs
from conformance.runtime.checkpoints import CheckpointError, CheckpointInfo, convert, restore, save
from conformance.runtime.training import flat_state, linen_trainer, nnx_trainer
from conformance.train_checks import Side, advance, compare_steps, linen_and_nnx


def trained_sides(
    family: Family, check: str, config: Any, mesh: MeshSpec, devices: Mesh
) -> tuple[dict[str, Side], Any]:
    """Both backends' placed train states after one step, and the batch used."""
    linen, nnx_side, mapping = linen_and_nnx(family, config, mesh, devices, check=check)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    advance(linen, nnx_side, mapping, batch)
    return {"linen": linen, "nnx": nnx_side}, batch


def _trainer(family: Family, config: Any, backend: str) -> Any:
    return (linen_trainer if backend == "linen" else nnx_trainer)(family, config)


def restore_checked(
    family: Family, check: str, directory: Path, target: Any, shardings: Any
) -> Flat:
    """:func:`~conformance.runtime.checkpoints.restore`; a refusal fails ``check``."""
    try:
        return restore(directory, target, shardings)
    except CheckpointError as err:
        fail(family, check, str(err))


def byte_differences(first: Flat, second: Flat) -> list[str]:
    """Leaves whose dtype or bytes differ, with the first differing index and values."""
    lines = [f"{p}: missing on one side" for p in sorted(first.keys() ^ second.keys())]
    for path in sorted(first.keys() & second.keys()):
        a, b = host_array(first[path]), host_array(second[path])
        if a.dtype != b.dtype:
            lines.append(f"{path}: dtype {a.dtype} != {b.dtype}")
        elif a.tobytes() != b.tobytes():
            found = compare_arrays(path, a, b, EXACT)
            lines.append(found.describe(("before", "after")) if found else f"{path}: bytes differ")
    return lines


def check_checkpoint_roundtrip(
    family: Family,
    info: CheckpointInfo,
    saved_on: tuple[MeshSpec, Mesh],
    restored_on: tuple[MeshSpec, Mesh],
    workdir: Path,
) -> None:
    """A train state saved with orbax restores byte-exact, with its dtypes.

    It is restored onto the shardings ``restored_on`` asks for: the mesh it was saved
    on, or another one (a reshard).
    """
    check = "checkpoint_roundtrip"
    config = family.config(info.size, scan_layers=info.scan_layers)
    sides, _ = trained_sides(family, check, config, *saved_on)
    state = flat_state(sides[info.backend].state)
    directory = Path(workdir) / "checkpoint"
    save(directory, state, info)
    trainer = _trainer(family, config, info.backend)
    shardings = shardings_for(family, check, trainer.logical, *restored_on)
    restored = restore_checked(family, check, directory, specs(state), shardings)
    where = f"{info.backend} saved on {saved_on[0].id}, restored on {restored_on[0].id}"
    differences = byte_differences(state, restored)
    fail_if_any(family, check, f"{where}: not byte-exact", differences)
    fail_if_any(family, check, f"{where}: shardings not as asked", misplaced(restored, shardings))


def check_checkpoint_conversion(
    family: Family,
    source: CheckpointInfo,
    scan_layers: bool,
    mesh: MeshSpec,
    devices: Mesh,
    workdir: Path,
) -> None:
    """A saved state converted to the other backend (and layout) is the same model.

    The converted checkpoint restores strictly into the other backend's train state; it
    gives the same forward and the same next train step as the original; converting it
    back gives the original byte for byte.
    """
    check = "checkpoint_conversion"
    target_backend = "nnx" if source.backend == "linen" else "linen"
    src_config, dst_config = (
        family.with_mesh(family.config(source.size, scan_layers=scan), devices)
        for scan in (source.scan_layers, scan_layers)
    )
    sides, batch = trained_sides(family, check, src_config, mesh, devices)
    original = sides[source.backend]
    state = flat_state(original.state)
    workdir = Path(workdir)
    save(workdir / "source", state, source)
    loaded = restore_checked(family, check, workdir / "source", specs(state), None)
    converted, info = convert(loaded, family, source, target_backend, scan_layers)
    save(workdir / "converted", converted, info)

    dst = _trainer(family, dst_config, target_backend)
    by_path = shardings_for(family, check, dst.logical, mesh, devices)
    restored = restore_checked(
        family, check, workdir / "converted", specs(flat_state(dst.abstract_state)), by_path
    )
    what = f"{source.backend}/{source.layout} -> {target_backend}/{info.layout} on {mesh.id}"

    params = {p.removeprefix("model/"): v for p, v in restored.items() if p.startswith("model/")}
    own = {p.removeprefix("model/"): v for p, v in state.items() if p.startswith("model/")}
    before = original.trainer.runner.forward(own, batch)[0]
    after = dst.runner.forward(params, batch)[0]
    trees = {"logits": before}, {"logits": after}
    found = compare_trees(*trees)
    names = ("original", "converted")
    if listening():
        emit(measure(f"forward after {what}", *trees, found, names=names))
    if found:
        fail(family, check, report(f"forward after {what}", found, names))

    # The reference next step runs on the source backend in the target layout, so that
    # only the backend conversion is compared: scanned and unrolled layers round
    # differently, and Adam turns rounding noise in a zero gradient (gpt3's key bias)
    # into a full step. Layouts are compared by the forward above and the round trip.
    relaid, relaid_info = convert(loaded, family, source, source.backend, scan_layers)
    reference = _trainer(family, dst_config, source.backend)
    ref_shardings = reference.tree(shardings_for(family, check, reference.logical, mesh, devices))
    ref_state = jax.device_put(reference.tree(relaid), ref_shardings)
    next_ref, metrics_ref = reference.step_fn(ref_shardings)(ref_state, batch)
    shardings = dst.tree(by_path)
    next_dst, metrics_dst = dst.step_fn(shardings)(
        jax.device_put(dst.tree(restored), shardings), batch
    )
    expected, _ = convert(flat_state(next_ref), family, relaid_info, target_backend, scan_layers)
    grads, _ = convert(
        {f"model/{p}": v for p, v in flat_state(metrics_ref["grads"]).items()},
        family,
        relaid_info,
        target_backend,
        scan_layers,
    )
    compare_steps(
        family,
        check,
        f"next train step after {what}",
        (expected, metrics_ref["loss"], {p.removeprefix("model/"): v for p, v in grads.items()}),
        (flat_state(next_dst), metrics_dst["loss"], flat_state(metrics_dst["grads"])),
        ("original", "converted"),
    )
    back, _ = convert(converted, family, info, source.backend, source.scan_layers)
    differences = byte_differences(state, back)
    fail_if_any(family, check, f"round trip {what} and back is not byte-exact", differences)
