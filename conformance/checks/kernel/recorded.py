"""A live side against a recorded reference: the pair, its parameters, steps and reports.

The recorded checks (:mod:`conformance.checks.recorded`) give a live side a reference's
parameters and batch on one device (the reference was recorded on one), run what was
recorded, and compare. What they share is here: loading the pair
(:func:`recorded_pair`), placing the recorded parameters (:func:`recorded_params`,
which names a leaf that changed collection), train steps against the recorded ones
within the live side's own spread (:func:`recorded_step_parity`), and the failure that
names the library versions changed since the recording (:func:`fail_against`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp

from conformance.checks.kernel.parity import step_rounding
from conformance.checks.kernel.steps import judged_disagreement
from conformance.contract import persistent_types
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import tolerance_for
from conformance.core.trees import Flat, mirrored_param
from conformance.runtime.case import Case
from conformance.runtime.recorded import RECORD_COMMAND, MissingReference, RecordedSide, load
from conformance.runtime.sides import SIDES, Side
from conformance.runtime.stepping import StepResult, Training


def recorded_pair(
    case: Case, backend: str, recorded: str, references: Path
) -> tuple[Side, RecordedSide]:
    """The live side of ``backend`` on ``case``'s one device, and the recorded reference."""
    case = case.on_one_device()
    try:
        reference = load(case.family, recorded, references)
    except MissingReference as err:
        fail(str(err))
    if reference.layout != case.layout:
        fail(
            f"{reference.label} was recorded in the {reference.layout} layout; the family "
            f"now prefers {case.layout}: record it again"
        )
    return SIDES[backend](case), reference


def persistent_state(live: Side) -> dict[str, str]:
    """``live``'s declared persistent state (not parameters): canonical path -> its kind."""
    declared = {kind.__name__ for kind in persistent_types(live.case.family)}
    own = {
        path.removeprefix("model/"): kind
        for path, kind in live.trainer().kinds.items()
        if path.startswith("model/") and kind in declared
    }
    return live.canonical(own)


def without_training(flat: Flat, persistent: Mapping[str, str]) -> Flat:
    """``flat`` (gradients or a train state) without what ``persistent`` state cannot have.

    A parameter that became persistent state (maxtext 0.2.5's MoE routing bias) is not
    trained any more: its recorded gradient and optimizer moments have no live
    counterpart, while its value (``model/...``) stays and is compared.
    """
    return {
        path: value
        for path, value in flat.items()
        if path.startswith("model/") or mirrored_param(path, persistent) is None
    }


def recorded_params(live: Side, reference: RecordedSide) -> Flat:
    """The recorded parameters placed on ``live``'s device; every leaf must fit, or it fails.

    A leaf that changed collection since the recording (a parameter that became another
    Variable type of the train state, or the reverse) is named as such first, unless it
    became the family's declared persistent state
    (:class:`~conformance.contract.PersistentState`, as maxtext 0.2.5's MoE routing bias
    did): that leaf is not a parameter any more, and reaches the live side through the
    recorded train state (``recorded_resume``).
    """
    held = set(live.runner.specs)
    persistent = persistent_state(live)
    params = live.own({p: v for p, v in reference.params().items() if p not in persistent})
    live_kinds = live.trainer().kinds
    recorded_kinds = live.own(dict(reference.state_kinds()))
    moved = [
        f"{path}: recorded as Param, live as {live_kinds[f'model/{path}']} (changed collection)"
        for path in sorted(set(params) - held)
        if live_kinds.get(f"model/{path}", "Param") != "Param"
    ]
    moved += [
        f"{path}: recorded as {recorded_kinds[f'model/{path}']}, live as Param (changed collection)"
        for path in sorted(held - set(params))
        if recorded_kinds.get(f"model/{path}", "Param") != "Param"
    ]
    fail_if_any(f"{live.name} cannot take the parameters of {reference.label}", moved)
    return live.place(params)


def _versions(reference: RecordedSide) -> str:
    changes = reference.version_changes()
    if not changes:
        return "recorded with the installed library versions"
    return (
        "library versions changed since the recording: "
        + ", ".join(changes)
        + f"; if the new numbers are intended, re-record: {RECORD_COMMAND} --family "
        + f"{reference.family.name} --backend {reference.backend} --update"
    )


def _untrained(live: Side, reference: RecordedSide) -> list[str]:
    """Each leaf the recording trained as a parameter that ``live`` keeps as state."""
    recorded = reference.state_kinds()
    return [
        f"{path}: a parameter when recorded, {kind} (persistent state, not trained) now"
        for path, kind in sorted(persistent_state(live).items())
        if recorded.get(f"model/{path}") == "Param"
    ]


def fail_against(live: Side, reference: RecordedSide, message: str) -> None:
    """Fail with ``message``, the verdict and the library versions that changed.

    A parameter that became persistent state is named too: it is no longer trained.
    """
    moved = "".join(f"\n  changed collection: {line}" for line in _untrained(live, reference))
    fail(
        f"{message}\n  verdict: {live.name} on one device, as recorded, differs from "
        f"{reference.label}{moved}\n  {_versions(reference)}"
    )


def against_title(live: Side, reference: RecordedSide, what: str) -> str:
    """``<live> vs <recorded label>: <what> on one device``: a report's title."""
    return f"{live.name} vs {reference.label}: {what} on one device"


def partitioned_side(side: Side, case: Case) -> Side:
    """``side`` on ``case``'s mesh: the same computation with its sums reordered.

    What it computes there beside what it computes on one device is the live side's own
    spread (:func:`~conformance.core.numerics.compare_arrays`): XLA compiles for the
    machine it runs on, so an element the live side does not compute the same way twice
    may differ from a recording made on another machine by about as much. Whether the
    live side agrees with itself is ``sharding_invariance``'s question.
    """
    return side.on(side.case.on(case.mesh, case.devices))


def beyond_spread_note(side: Side, case: Case, what: str) -> str:
    """The line a failure compared within ``side``'s own spread ends with."""
    return (
        f"compared again with {side.name}'s own spread ({what} partitioned on mesh "
        f"{case.mesh.id}): these elements differ by more than its own runs do"
    )


def require_training(reference: RecordedSide, dtype: str, *, state: bool = False) -> None:
    """Fail unless ``reference`` holds train steps in compute ``dtype``.

    With ``state``, the whole state after step 1 too. The failure names the command that
    adds them to a reference an earlier harness recorded.
    """
    if not reference.trained_in(dtype, state=state):
        what = "train state" if state else "train steps"
        fail(
            f"{reference.label} holds no {what} in {dtype} compute (recorded by an earlier "
            f"harness): add them with {RECORD_COMMAND} --family {reference.family.name} "
            f"--backend {reference.backend} --extend"
        )


def _recorded_steps(
    reference: RecordedSide, first: int, persistent: Mapping[str, str], dtype: str
) -> list[StepResult]:
    """The recorded steps in compute ``dtype`` from ``first`` on.

    Step 1 in float32 with its whole state, others without (none other is recorded).
    What ``persistent`` state cannot have (gradients, moments) is left out.
    """
    steps = []
    for step in range(first, reference.steps + 1):
        loss, grads = reference.step(step, dtype)
        whole = step == 1 and dtype == "float32"
        state = reference.state_after_first_step(dtype) if whole else {}
        grads, state = (without_training(tree, persistent) for tree in (grads, state))
        steps.append((state, loss, grads))
    return steps


def recorded_step_parity(
    case: Case,
    live: Side,
    reference: RecordedSide,
    what: str,
    start: Callable[[Side], Training],
    first: int,
) -> None:
    """Steps ``first`` onward of ``start(live)`` on the recorded batch equal the recorded ones.

    In ``live``'s compute dtype; only float32's step 1 compares the whole state (the
    recording keeps no other). A step that disagrees is compared again with the same
    steps run partitioned on ``case``'s mesh
    (:func:`~conformance.checks.kernel.step_disagreement`'s ``spread``): XLA compiles
    for the machine it runs on, so an element the live side does not compute the same way
    twice (an ill-conditioned sum, a parameter Adam moves by its gradient's sign) may
    differ from a recording made elsewhere by as much as its own runs differ here. Below
    float32 a step beyond that dtype's policy passes when it is within rounding of the
    recorded one (:func:`~conformance.checks.kernel.step_rounding`, against the recorded
    float32 step); float32 itself is the float32 case's to judge.
    """
    dtype = jnp.dtype(live.case.dtype).name
    require_training(reference, dtype)
    persistent = persistent_state(live)
    recorded = _recorded_steps(reference, first, persistent, dtype)
    twins = None if dtype == "float32" else _recorded_steps(reference, first, persistent, "float32")
    tolerance = None if twins is None else tolerance_for(live.case.dtype)
    batch = live.case.place(reference.batch())
    training = start(live)
    partitioned: list[StepResult] = []

    def spread(step: int) -> StepResult:
        if not partitioned:
            side = partitioned_side(live, case)
            rerun, on_mesh = start(side), side.case.place(reference.batch())
            partitioned.extend(rerun.advance(on_mesh) for _ in recorded)
        state, loss, grads = partitioned[step - first]
        return (state if step == 1 and twins is None else {}, loss, grads)

    for index, want in enumerate(recorded):
        step = first + index
        state, loss, grads = training.advance(batch)
        got = (state if step == 1 and twins is None else {}, loss, grads)
        title = against_title(live, reference, f"{what}, step {step} of {reference.steps}")
        if twins is not None:
            title += f" ({dtype} compute)"
        names = (reference.name, live.name)
        judge = None
        if twins is not None:
            twin = ({}, *twins[index][1:])
            judge = functools.partial(step_rounding, (want, got), twin, tolerance)
        message = judged_disagreement(
            title,
            want,
            got,
            names,
            judge=judge,
            tolerance=tolerance,
            spread=functools.partial(spread, step),
        )
        if message is not None:
            spread_note = beyond_spread_note(live, case, "the same steps")
            fail_against(
                live, reference, f"{message}\n  Adam's noise steps set aside, {spread_note}"
            )
