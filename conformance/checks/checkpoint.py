"""Checkpoint checks: orbax round trips and Linen <-> NNX conversion, strict and lossless.

Each round trip starts from a state one train step old (non-zero Adam moments, step 1),
so a conversion that drops, swaps or resets optimizer state cannot pass by accident.
The resume checks train on from a restored (or converted) checkpoint and compare every
later step with the same steps run straight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from conformance.checks.declare import BACKENDS, ON_MESH, SIDE_VALUES, Axis, Param, declare
from conformance.checks.kernel import (
    DROPOUT_RATE,
    judged_disagreement,
    misplaced,
    rerun_note,
    restored_into,
    step_tree,
    steps_agree,
    train_pair,
    twin_verdict,
)
from conformance.contract import Backend, Dropout, declared
from conformance.core.distributed import host_array
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import (
    EXACT,
    Tolerance,
    compare_arrays,
    compare_trees,
    report,
    tolerance_for,
)
from conformance.core.records import emit, failed, listening, measure
from conformance.core.rounding import RoundingVerdict
from conformance.core.trees import Flat, specs
from conformance.runtime.case import Case
from conformance.runtime.checkpoints import CheckpointError, CheckpointInfo, convert, restore, save
from conformance.runtime.sides import SIDES, live_pair
from conformance.runtime.stepping import StepResult, Training, params_of
from conformance.runtime.train_state import flat_state

RESUME_STEPS = 2
"""Steps :func:`check_resume` takes before its save, and again after its restore."""


def trained(case: Case) -> dict[str, Training]:
    """Both backends' placed train states on ``case`` after one step, by backend id."""
    pair = train_pair(case)
    batch = case.batch()
    for training in pair:
        training.advance(batch)
    return {training.side.backend: training for training in pair}


def restore_checked(directory: Path, target: Any, shardings: Any) -> Flat:
    """:func:`~conformance.runtime.checkpoints.restore`; a refusal fails the check."""
    try:
        return restore(directory, target, shardings)
    except CheckpointError as err:
        fail(str(err))


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


_CONVERSIONS = (
    (
        "layouts",
        tuple(
            Param(f"{source}-{target}", (s, t), layouts=(s, t))
            for (source, s), (target, t) in (
                (("loop", False), ("loop", False)),
                (("scan", True), ("scan", True)),
                (("loop", False), ("scan", True)),
                (("scan", True), ("loop", False)),
            )
        ),
    ),
    ("source", SIDE_VALUES),
)
"""A conversion's parameters: the layer layouts it converts between, and its source."""


@declare(ON_MESH, BACKENDS, workdir=True, saved_on=True, pair=False)
def check_checkpoint_roundtrip(case: Case, backend: str, saved_on: Case, workdir: Path) -> None:
    """A train state saved with orbax restores byte-exact, with its dtypes.

    ``backend``'s state is trained and saved on ``saved_on`` (the run's primary mesh)
    and restored onto the shardings of ``case``'s mesh: the same mesh, or another one
    (a reshard).
    """
    info = CheckpointInfo(case.family.name, case.size, backend, case.scan_layers)
    training = trained(saved_on)[backend]
    state = flat_state(training.state)
    directory = Path(workdir) / "checkpoint"
    save(directory, state, info)
    shardings = case.shardings(training.trainer.logical)
    restored = restore_checked(directory, specs(state), shardings)
    where = f"{backend} saved on {saved_on.mesh.id}, restored on {case.mesh.id}"
    fail_if_any(f"{where}: not byte-exact", byte_differences(state, restored))
    fail_if_any(f"{where}: shardings not as asked", misplaced(restored, shardings))


@declare((Axis.FAMILY,), _CONVERSIONS, where="primary", workdir=True)
def check_checkpoint_conversion(
    case: Case, source: str, layouts: tuple[bool, bool], workdir: Path
) -> None:
    """A saved state converted to the other backend (and layout) is the same model.

    ``source``'s state in the first of ``layouts`` (``True``: scanned) is saved and
    converted to the other backend in the second; the converted checkpoint restores
    strictly into the other backend's train state, gives the same forward and the same
    next train step as the original, and converting it back gives the original byte for
    byte.
    """
    family = case.family
    case, target = (
        Case.of(family, case.size, scan_layers=scan, mesh=case.mesh, devices=case.devices)
        for scan in layouts
    )
    target_scan = target.scan_layers
    info_in = CheckpointInfo(family.name, case.size, source, case.scan_layers)
    target_backend = Backend(source).other
    sides = trained(case)
    original = sides[source]
    batch = case.batch()
    state = flat_state(original.state)
    workdir = Path(workdir)
    save(workdir / "source", state, info_in)
    loaded = restore_checked(workdir / "source", specs(state), None)
    converted, info = convert(loaded, family, info_in, target_backend, target_scan)
    save(workdir / "converted", converted, info)

    dst = SIDES[target_backend](target).trainer()
    by_path = case.shardings(dst.logical)
    restored = restore_checked(
        workdir / "converted", specs(flat_state(dst.abstract_state)), by_path
    )
    what = f"{source}/{info_in.layout} -> {target_backend}/{info.layout} on {case.mesh.id}"

    before = original.trainer.runner.forward(
        params_of(state, original.trainer.runner.specs), batch
    )[0]
    after = dst.runner.forward(params_of(restored, dst.runner.specs), batch)[0]
    trees = {"logits": before}, {"logits": after}
    found = compare_trees(*trees)
    names = ("original", "converted")
    if listening():
        emit(measure(f"forward after {what}", *trees, found, names=names))
    if found:
        fail(report(f"forward after {what}", found, names))

    # The reference next step runs on the source backend in the target layout, so that
    # only the backend conversion is compared: scanned and unrolled layers round
    # differently, and Adam turns rounding noise in a zero gradient (gpt3's key bias)
    # into a full step. Layouts are compared by the forward above and the round trip.
    relaid, relaid_info = convert(loaded, family, info_in, source, target_scan)
    reference = SIDES[source](target).trainer()
    ref_shardings = reference.tree(case.shardings(reference.logical))
    ref_state = jax.device_put(reference.tree(relaid), ref_shardings)
    next_ref, metrics_ref = reference.step_fn(ref_shardings)(ref_state, batch)
    shardings = dst.tree(by_path)
    next_dst, metrics_dst = dst.step_fn(shardings)(
        jax.device_put(dst.tree(restored), shardings), batch
    )
    expected, _ = convert(flat_state(next_ref), family, relaid_info, target_backend, target_scan)
    grads, _ = convert(
        {f"model/{p}": v for p, v in flat_state(metrics_ref["grads"]).items()},
        family,
        relaid_info,
        target_backend,
        target_scan,
    )
    steps_agree(
        f"next train step after {what}",
        (expected, metrics_ref["loss"], params_of(grads, dst.runner.specs)),
        (flat_state(next_dst), metrics_dst["loss"], flat_state(metrics_dst["grads"])),
        ("original", "converted"),
    )
    back, _ = convert(converted, family, info, source, case.scan_layers)
    fail_if_any(f"round trip {what} and back is not byte-exact", byte_differences(state, back))


@declare(
    (Axis.FAMILY, Axis.DTYPE),
    BACKENDS,
    where="primary",
    workdir=True,
    pair=False,
    suite="train_step",
)
def check_resume(case: Case, backend: str, workdir: Path) -> None:
    """Twice :data:`RESUME_STEPS` steps straight equal a resumed run, exactly.

    The resumed run takes :data:`RESUME_STEPS` steps, saves its state with orbax,
    restores it strictly (byte for byte what was saved) into a fresh train state and
    takes as many more. On ``backend``, in float32 or bfloat16 compute (parameters and
    optimizer state stay float32, as saved), with dropout on when the family has it,
    every step after the restore must give the straight run's loss and gradients bit
    for bit, and the final state (parameters, Adam moments, optax counts, the step
    counter every dropout key derives from) must be byte-identical: a restore that
    resets the optimizer state or the step counter (the schedule and the RNG streams
    restart), or a checkpoint that stores float32 state in the compute dtype, is caught.
    """
    if (dropout := declared(case.family, Dropout)) is not None:
        case = case.with_config(dropout.config(case.config, DROPOUT_RATE))
    side, batch = SIDES[backend](case), case.batch()
    straight = Training.start(side)
    expected = [straight.advance(batch) for _ in range(2 * RESUME_STEPS)][RESUME_STEPS:]
    first = Training.start(side)
    for _ in range(RESUME_STEPS):
        first.advance(batch)
    saved = flat_state(first.state)
    directory = Path(workdir) / "resume"
    save(directory, saved, CheckpointInfo(case.family.name, case.size, backend, case.scan_layers))
    resumed = Training.start(side)
    what = f"{side.name} state restored from the checkpoint of step {RESUME_STEPS}"
    restored_into(directory, saved, resumed, what)
    total = 2 * RESUME_STEPS
    for step, want in enumerate(expected, start=RESUME_STEPS + 1):
        mismatches = compare_trees(step_tree(want), step_tree(resumed.advance(batch)), EXACT)
        if mismatches:
            title = (
                f"{side.name} step {step} of {total} on mesh {case.mesh.id}, resumed from a "
                f"checkpoint of step {RESUME_STEPS}, against the same step run straight"
            )
            fail(failed(title, mismatches, ("straight", "resumed")) + rerun_note())


@declare(
    (Axis.FAMILY, Axis.DTYPE, Axis.PAIR),
    where="primary",
    workdir=True,
    suite="train_step",
    costly_pairs=True,
)
def check_resume_conversion(case: Case, workdir: Path) -> None:
    """Linen's steps, saved, converted to NNX and continued there, equal Linen's straight.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis: graph
    mode's checkpoint resumed in tree mode, auto axes' on explicit ones). The first side
    takes :data:`RESUME_STEPS` steps and saves its state; the checkpoint is restored,
    converted to the second side's backend
    (:func:`~conformance.runtime.checkpoints.convert`) and placed into a fresh train
    state of the second side (every leaf, no more), which takes as many more steps. Each
    of those equals the same step of the first side run straight, within the tolerance
    policy: the migration's own path from a Linen run to an NNX one. In bfloat16 compute
    (float32 parameters and optimizer state) a step beyond the policy passes when the
    same path in float32 compute agrees and every leaf beyond it is within rounding of
    the first side's (:func:`~conformance.checks.kernel.twin_verdict`).
    """
    first, second = live_pair(case)
    steps = _converted_run(case, Path(workdir) / first.key)
    twins = None
    if case.dtype != jnp.float32:
        f32 = Path(workdir) / f"{first.key}-float32"
        twins = functools.cache(lambda: _converted_run(case.in_dtype(jnp.float32), f32))
    tolerance = None if twins is None else tolerance_for(case.dtype)
    total = 2 * RESUME_STEPS
    names = (f"{first.name} straight", f"{second.name} resumed")
    apart = any(side.lays_out_itself for side in (first, second))
    mode = "" if twins is None else f" ({jnp.dtype(case.dtype).name} compute)"
    for index, (want, got) in enumerate(steps):
        step = RESUME_STEPS + 1 + index
        title = (
            f"step {step} of {total}{mode} on mesh {case.mesh.id}: {second.name} resumed from "
            f"{first.name}'s checkpoint of step {RESUME_STEPS}, against {first.name} run "
            "straight"
        )
        judge = None
        if twins is not None:
            judge = functools.partial(_judged, (want, got), twins, index, tolerance, apart)
        message = judged_disagreement(
            title,
            want,
            got,
            names,
            judge=judge,
            tolerance=tolerance,
            partitioned_apart=apart,
        )
        if message is not None:
            fail(message)


def _judged(
    steps: tuple[StepResult, StepResult],
    twins: Callable[[], list[tuple[StepResult, StepResult]]],
    index: int,
    tolerance: Tolerance,
    partitioned_apart: bool,
) -> RoundingVerdict:
    """:func:`~conformance.checks.kernel.twin_verdict` of step ``index`` after the save."""
    return twin_verdict(steps, twins()[index], tolerance, partitioned_apart=partitioned_apart)


def _converted_run(case: Case, directory: Path) -> list[tuple[StepResult, StepResult]]:
    """Each step after the save: the first side's run straight, and the second's resumed.

    The second side (NNX, in a mode or not) resumes from the first's save, converted to
    NNX's paths; leaves it holds on purpose where the first holds none (a tree-mode
    rewrite's accepted parameters, with their moments) start as their sources
    (:meth:`~conformance.runtime.sides.Side.own`).
    """
    first, second = live_pair(case)
    batch, family = case.batch(), case.family
    straight = Training.start(first)
    expected = [straight.advance(batch) for _ in range(2 * RESUME_STEPS)][RESUME_STEPS:]
    before = Training.start(first, straight.initial)
    for _ in range(RESUME_STEPS):
        before.advance(batch)
    saved = flat_state(before.state)
    info = CheckpointInfo(family.name, case.size, first.backend, case.scan_layers)
    save(directory, saved, info)
    try:
        loaded = restore(directory, specs(saved))
        converted, _ = convert(loaded, family, info, second.backend, case.scan_layers)
    except CheckpointError as err:
        fail(str(err))
    converted = second.own(converted)  # converted to NNX's paths, the canonical ones
    resumed = Training.start(second, second.own(first.canonical(straight.initial)))
    layout = specs(flat_state(resumed.state))
    problems = [
        f"{p}: converted, but not in {second.name}'s state"
        for p in sorted(set(converted) - set(layout))
    ]
    problems += [
        f"{p}: in {second.name}'s state, not converted"
        for p in sorted(set(layout) - set(converted))
    ]
    fail_if_any(
        f"{first.name}'s checkpoint of step {RESUME_STEPS} does not fit {second.name}", problems
    )
    resumed.state = jax.device_put(resumed.trainer.tree(converted), resumed.shardings)
    return [(want, resumed.advance(batch)) for want in expected]
