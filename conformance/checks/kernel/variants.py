"""A train step with a variant that must not change numerics, against the plain step.

:func:`variant_parity` runs one step of both sides plain and with a variant (micro-batches
accumulated, a tiled loss) from the same parameters, and compares them on each backend
and the varied steps across backends, in float32 or, judged by rounding, in bfloat16.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from conformance.checks.kernel.parity import twin_verdict
from conformance.checks.kernel.steps import steps_agree, train_pair
from conformance.core.numerics import tolerance_for
from conformance.core.rounding import RoundingVerdict
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.sides import live_pair
from conformance.runtime.stepping import StepResult


def _plain_and_variant(
    case: Case, variant: Mapping[str, Any], start: Flat | None = None
) -> tuple[Flat, tuple[StepResult, ...], tuple[StepResult, ...]]:
    """One step of both sides, plain and with ``variant``: ``(start, plain, varied)``.

    ``variant`` holds keywords of :func:`~conformance.checks.kernel.steps.train_pair`; both
    steps start from the same parameters.
    """
    batch = case.batch()
    plain = train_pair(case, start)
    start = plain[0].initial
    varied = train_pair(case, start, **variant)
    return (
        start,
        tuple(side.advance(batch) for side in plain),
        tuple(side.advance(batch) for side in varied),
    )


_Pick = Callable[[tuple[Any, ...]], tuple[StepResult, StepResult]]
"""Two steps found in ``(plain steps, varied steps)``, each a pair of both backends' steps."""

_Judge = Callable[[], RoundingVerdict]


def _backend(index: int) -> _Pick:
    """Backend ``index``'s plain and varied steps."""
    return lambda results: (results[0][index], results[1][index])


def variant_parity(case: Case, names: tuple[str, str], variant: Mapping[str, Any]) -> None:
    """One step with ``variant`` equals the plain step, on each backend and across.

    ``names`` name the plain and the varied step in reports. A failure also says
    whether each result agrees with the same step on one device. In a lower compute
    dtype (bfloat16) every leaf is held to that dtype's tolerance, and a pair beyond it
    passes when it differs by rounding
    (:func:`~conformance.checks.kernel.parity.twin_verdict`: the same pair in float32 compute
    agrees, and each leaf is within twice the first step's own distance from its
    float32 twin).
    """
    start, plain, varied = _plain_and_variant(case, variant)

    @functools.cache
    def reference() -> tuple[Any, ...]:
        return _plain_and_variant(case.on_one_device(), variant, start)[1:]

    @functools.cache
    def floats() -> tuple[Any, ...]:
        return _plain_and_variant(case.in_dtype(jnp.float32), variant, start)[1:]

    lower = case.dtype != jnp.float32
    tolerance = tolerance_for(case.dtype) if lower else None

    def judge(pick: _Pick, steps: tuple[StepResult, StepResult]) -> _Judge | None:
        """Below float32, the rounding judge of ``steps``, found by ``pick`` in results."""
        if not lower:
            return None
        return lambda: twin_verdict(steps, pick(floats()), tolerance)

    what = f"one step on mesh {case.mesh.id}"
    for i, side in enumerate(live_pair(case)):
        pick = _backend(i)
        steps_agree(
            f"{side.name} {what}",
            plain[i],
            varied[i],
            names,
            case=case,
            reference=functools.partial(lambda pick: pick(reference()), pick),
            judge=judge(pick, (plain[i], varied[i])),
            tolerance=tolerance,
        )
    steps_agree(
        f"{names[1]}, {what}",
        varied[0],
        varied[1],
        case=case,
        reference=lambda: reference()[1],
        judge=judge(operator.itemgetter(1), varied),
        tolerance=tolerance,
    )
