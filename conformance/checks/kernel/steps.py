"""Train steps compared: both sides' steps from the same parameters, leaf by leaf.

:func:`train_pair` starts both sides from the same parameters and :func:`train_steps`
takes :data:`STEPS` steps of each; :func:`step_disagreement` compares two steps' loss,
gradients and next state, and a failure on a mesh says which side moves on one device.
What a step beyond the policy is judged by lives in :mod:`.parity`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.checks.kernel.layouts import paired
from conformance.checks.kernel.logits import attributed
from conformance.core.environment import nondeterminism
from conformance.core.failure import fail
from conformance.core.numerics import Tolerance, compare_trees, report
from conformance.core.records import emit, listening, measure
from conformance.core.rounding import (
    RoundingVerdict,
)
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.diagnose.attribution import noise_masked
from conformance.runtime.sides import live_pair
from conformance.runtime.stepping import StepResult, Training
from conformance.runtime.transplant import TransplantError

STEPS = 3
"""Train steps compared for parity."""

DROPOUT_RATE = 0.1
"""Dropout rate the checks that train with dropout on ask :meth:`~Family.variant` for."""


def train_pair(
    case: Case,
    start: Flat | None = None,
    *,
    micro_batches: int = 1,
    vocab_tiles: int = 1,
) -> tuple[Training, Training]:
    """Both sides' train states on ``case``, the second holding the first's parameters.

    The sides are :func:`~conformance.runtime.sides.live_pair`'s; the first's parameters
    ``start`` (its paths) or its init from seed 0. With ``micro_batches`` or ``vocab_tiles``
    above 1 both accumulate or tile their loss, which must not change the parameters.
    Parameters that do not fit a side fail the check, naming every leaf.
    """
    first, second = live_pair(case)
    paired(first, second)
    try:
        a = Training.start(first, start, micro_batches, vocab_tiles)
        b = Training.start(
            second, second.own(first.canonical(a.initial)), micro_batches, vocab_tiles
        )
    except TransplantError as err:
        variant = {
            k: v
            for k, v in (("micro_batches", micro_batches), ("vocab_tiles", vocab_tiles))
            if v != 1
        }
        fail(f"the parameters change with {variant}: {err}" if variant else str(err))
    return a, b


def train_steps(case: Case, start: Flat | None = None) -> tuple[Flat, list[tuple[StepResult, ...]]]:
    """:data:`STEPS` steps of both sides from the same parameters: ``(start, results)``."""
    (a, b), batch = train_pair(case, start), case.batch()
    return a.initial, [(a.advance(batch), b.advance(batch)) for _ in range(STEPS)]


def rerun_note() -> str:
    """The last line of a report that two runs differ bit for bit: why, where they can.

    Empty where the backend is deterministic (:func:`~conformance.core.environment.nondeterminism`).
    """
    note = nondeterminism()
    return f"\n  {note}" if note else ""


def step_tree(result: StepResult) -> Flat:
    """A step's results as one flat tree: ``loss``, ``grads/<path>`` and ``state/<path>``."""
    state, loss, grads = result
    return {
        "loss": loss,
        **{f"grads/{path}": value for path, value in grads.items()},
        **{f"state/{path}": value for path, value in state.items()},
    }


def leaf_group(path: str) -> str:
    """The group a step leaf is plotted in: its module, at most four components deep.

    ``grads/decoder/layers_0/mlp/wi/kernel`` is in ``grads/decoder/layers_0/mlp``;
    ``loss`` is a group of its own.
    """
    return "/".join(path.split("/")[:-1][:4]) or path


def _by_group(first: Flat, second: Flat) -> dict[str, tuple[Flat, Flat]]:
    groups: dict[str, tuple[Flat, Flat]] = {}
    for path in sorted(set(first) & set(second)):
        a, b = groups.setdefault(leaf_group(path), ({}, {}))
        a[path], b[path] = first[path], second[path]
    return groups


def step_disagreement(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    case: Case | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
    figure: str = "",
    series: str = "",
    spread: Callable[[], StepResult] | None = None,
    tolerance: Tolerance | None = None,
    partitioned_apart: bool = False,
) -> str | None:
    """The report of two steps' ``(state, loss, grads)`` disagreeing, or ``None``.

    Emits the error of each leaf group (:func:`leaf_group`) as a measurement of
    ``figure`` (default ``what``), line ``series`` (default ``what``). With ``case`` and
    ``reference`` (the same two steps on one device, computed only on failure), the
    report says which side computes differently when partitioned. With ``spread`` (the
    second step computed again in another order, only on failure), the steps are
    compared again leaf by leaf: an updated parameter whose gradient is rounding noise
    on both sides (:func:`~conformance.runtime.diagnose.attribution.noise_masked`) and
    an element within the second side's own spread
    (:func:`~conformance.core.numerics.compare_arrays`) pass. With ``partitioned_apart``
    (:attr:`~conformance.runtime.live.Side.lays_out_itself`) such parameters are never
    compared, on the mesh or on one device.
    """
    pair = (step_tree(first), step_tree(second))
    pair = (pair[0], noise_masked(*pair)[0]) if partitioned_apart else pair
    mismatches = compare_trees(*pair, tolerance)
    if mismatches and spread is not None:
        pair = (pair[0], noise_masked(*pair)[0])
        mismatches = compare_trees(*pair, tolerance, spread=step_tree(spread()))
    if listening():
        for group, (a, b) in _by_group(*pair).items():
            found = [m for m in mismatches if leaf_group(m.path) == group]
            plot = {"figure": figure or what, "series": series or what, "x": group}
            emit(measure(f"{what}: {group}", a, b, found, names=names, **plot))
    if not mismatches:
        return None
    message = report(what, mismatches, names)
    if case is not None and reference is not None:

        def one_device() -> tuple[Flat, Flat]:
            a, b = (step_tree(r) for r in reference())
            return (a, noise_masked(a, b)[0]) if partitioned_apart else (a, b)

        message += "\n  " + attributed(case, names, pair, one_device)
    return message


def judged_disagreement(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    judge: Callable[[], RoundingVerdict] | None = None,
    tolerance: Tolerance | None = None,
    **measured: Any,
) -> str | None:
    """:func:`step_disagreement`'s report, unless ``judge`` accepts what lies beyond ``tolerance``.

    ``judge`` (called only when some leaf is beyond ``tolerance``) says whether the two
    steps differ by rounding; its reasons end a report it rejects. ``measured`` are
    :func:`step_disagreement`'s other keywords.
    """
    verdict = None
    if judge is not None and compare_trees(step_tree(first), step_tree(second), tolerance):
        verdict = judge()
        if verdict.accepted:
            return None
    message = step_disagreement(what, first, second, names, tolerance=tolerance, **measured)
    if message is None or verdict is None:
        return message
    return f"{message}\n  {verdict.text}"


def steps_agree(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    case: Case | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
    judge: Callable[[], RoundingVerdict] | None = None,
    tolerance: Tolerance | None = None,
) -> None:
    """Fail with :func:`judged_disagreement`'s report unless the two steps agree."""
    message = judged_disagreement(
        what,
        first,
        second,
        names,
        judge=judge,
        tolerance=tolerance,
        case=case,
        reference=reference,
    )
    if message is not None:
        fail(message)
