"""Train-step parity, and the verdicts on steps beyond the tolerance policy.

:func:`train_step_parity` runs :data:`~conformance.checks.kernel.steps.STEPS` steps of
both sides and compares each step's loss, gradients and next state; a quantized step
that fails the float policy is judged by the float steps from the same parameters
(:func:`rounding_step`), a bfloat16 one by them and each side's own spread
(:func:`spread_verdict`), and a step resumed from a checkpoint by its float32 twin
(:func:`twin_verdict`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from conformance.checks.kernel.steps import (
    STEPS,
    judged_disagreement,
    step_tree,
    train_steps,
)
from conformance.core.distributed import host_array
from conformance.core.failure import fail
from conformance.core.numerics import Tolerance, compare_trees, tolerance_for
from conformance.core.rounding import (
    SENSITIVITY_FACTOR,
    STEP_NUDGE_SEEDS,
    RoundingVerdict,
    one_ulp_nudge,
    relative_l2,
    rounding_verdict,
    twins_disagree,
    within_rounding,
)
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.diagnose.attribution import noise_masked
from conformance.runtime.sides import live_pair
from conformance.runtime.stepping import StepResult


def train_step_parity(case: Case, title: str, float_case: Case | None = None) -> None:
    """The case's two sides agree for :data:`STEPS` jitted, sharded steps from the same params.

    Compares per step the loss, every gradient, and the whole next state (parameters,
    Adam moments, optax counts and the step counter, which must equal the step number).
    ``title`` names the mode in reports and plots. A failure also says whether each
    side agrees with its own steps on one device. A case in a lower compute dtype
    (bfloat16) is held to that dtype's tolerance, though its leaves are float32. With
    ``float_case`` (the same case unquantized, or in float32 compute) a step that fails
    the policy is judged by the
    float steps from the same parameters: quantization-aware for a quantized case
    (:func:`rounding_step`), by each side's own spread for a lower compute dtype
    (:func:`spread_verdict`).
    """
    start, steps = train_steps(case)

    @functools.cache
    def reference() -> list[tuple[StepResult, ...]]:
        return train_steps(case.on_one_device(), start)[1]

    @functools.cache
    def floats() -> list[tuple[StepResult, ...]]:
        return train_steps(float_case, start)[1]

    quantized = None
    if float_case is not None and case.quant is not None:
        quantized = rounding_step(case, float_case, start)

    def judge(index: int, steps: tuple[StepResult, ...]) -> Callable[[], RoundingVerdict] | None:
        """The judge of step ``index`` beyond the policy, if ``float_case`` gives one."""
        if quantized is not None:
            return functools.partial(quantized, index, steps)
        if float_case is None:
            return None
        bound = tolerance_for(case.dtype)
        return lambda: spread_verdict(steps, floats()[index], reference()[index], bound)

    lower = case.quant is None and case.dtype != jnp.float32
    tolerance = tolerance_for(case.dtype) if lower else None
    mode = "" if case.dtype == jnp.float32 else f" ({jnp.dtype(case.dtype).name} compute)"
    mode = mode if case.quant is None else f" ({case.quant})"
    failures: list[str] = []

    def attribution(step: int) -> Callable[[], tuple[StepResult, ...]] | None:
        return None if failures else functools.partial(lambda i: reference()[i], step - 1)

    sides = live_pair(case)
    # Every step is measured, so a report shows how the error grows; the first failing
    # step's report (with its one-device attribution) is the verdict.
    for step, (first, second) in enumerate(steps, start=1):
        message = judged_disagreement(
            f"step {step} of {STEPS}{mode} on mesh {case.mesh.id}",
            first,
            second,
            (sides[0].name, sides[1].name),
            judge=judge(step - 1, (first, second)),
            tolerance=tolerance,
            case=case,
            reference=attribution(step),
            figure=f"{title}{mode}: error per leaf group and step, mesh {case.mesh.id}",
            series=f"step {step}",
            partitioned_apart=any(side.lays_out_itself for side in sides),
        )
        counter = int(second[0]["optimizer/step"])
        if message is None and counter != step:
            message = f"optimizer/step is {counter} after step {step}"
        if message is not None:
            failures.append(message)
    if failures:
        fail(failures[0])


def _twins_disagree(
    twins: tuple[StepResult, ...], partitioned_apart: bool = False
) -> RoundingVerdict | None:
    """A verdict rejecting a low-precision pair whose float32 ``twins`` disagree too.

    With ``partitioned_apart``, parameters whose gradient is rounding noise on both
    sides are not compared (:func:`step_disagreement`).
    """
    pair = (step_tree(twins[0]), step_tree(twins[1]))
    pair = (pair[0], noise_masked(*pair)[0]) if partitioned_apart else pair
    return twins_disagree(
        "float32 steps", pair, "a divergence the lower precision carries, not rounding"
    )


def _beyond_rounding(figures: str, rejected: list[str]) -> RoundingVerdict:
    """A rejecting verdict: ``figures``, then the first five ``rejected`` leaves."""
    more = f"; and {len(rejected) - 5} more" if len(rejected) > 5 else ""
    return RoundingVerdict(
        False,
        f"{figures}: {len(rejected)} leaf(s) differ more than rounding moves them: "
        + "; ".join(rejected[:5])
        + more,
    )


def spread_verdict(
    steps: tuple[StepResult, ...],
    twins: tuple[StepResult, ...],
    alone: tuple[StepResult, ...],
    tolerance: Tolerance,
) -> RoundingVerdict:
    """Whether two steps in a lower compute dtype (bfloat16) differ by rounding only.

    ``twins`` are the same two steps in float32 compute, ``alone`` the same two steps on
    one device. Accepted when the twins agree within the float32 policy, and each leaf
    outside ``tolerance`` is finite on both sides and no farther apart in relative L2
    than :data:`~conformance.core.rounding.SENSITIVITY_FACTOR` times the least either
    step on the mesh is from its own step on one device: two programs that round in
    another order move that far by themselves (one sample of it, hence the factor). A
    side that computes something else moves the float32 steps apart, or its
    low-precision steps beyond that spread.
    """
    if (disagree := _twins_disagree(twins)) is not None:
        return disagree
    pair = [step_tree(result) for result in steps]
    single = [step_tree(result) for result in alone]
    rows = [(0.0, 0.0, "")]
    for path in sorted(m.path for m in compare_trees(*pair, tolerance)):
        if any(path not in tree for tree in (*pair, *single)):
            rows.append((float("inf"), 0.0, path))
            continue
        gap = relative_l2(pair[1][path], pair[0][path])
        moves = [relative_l2(p[path], a[path]) for p, a in zip(pair, single, strict=True)]
        reach = SENSITIVITY_FACTOR * min(moves)
        finite = all(np.isfinite(host_array(p[path])).all() for p in pair)
        rows.append((gap if finite else float("inf"), reach, path))
    beyond = [f"{p}: {g:.3e} apart, bound {r:.3e}" for g, r, p in rows if g > r]
    gap, reach, path = max(rows)
    figures = (
        "the float32 steps agree; of the leaves beyond tolerance, the worst in relative "
        f"L2, {path}, is {gap:.3e} "
        f"apart, its bound {reach:.3e}: {SENSITIVITY_FACTOR:g}x the least either "
        "step on the mesh moves from its own step on one device"
    )
    if beyond:
        return _beyond_rounding(figures, beyond)
    return RoundingVerdict(True, f"{figures}: rounding, accepted")


def twin_verdict(
    steps: tuple[StepResult, ...],
    twins: tuple[StepResult, ...],
    tolerance: Tolerance,
    *,
    partitioned_apart: bool = False,
) -> RoundingVerdict:
    """Whether two steps in a lower compute dtype (bfloat16) differ by rounding only.

    ``twins`` are the same two steps in float32 compute, from the same parameters.
    Accepted when the twins agree within the float32 policy and the steps are within
    rounding of each other (:func:`step_rounding`, against the first step's twin). Needs
    no run beyond the float32 twins, which the same check in float32 compiles. With
    ``partitioned_apart`` (a side that lays values out itself), the twins are compared
    as :func:`step_disagreement` compares such steps.
    """
    if (disagree := _twins_disagree(twins, partitioned_apart)) is not None:
        return disagree
    verdict = step_rounding(steps, twins[0], tolerance)
    return RoundingVerdict(verdict.accepted, f"the float32 steps agree; {verdict.text}")


def step_rounding(
    steps: tuple[StepResult, ...], twin: StepResult, tolerance: Tolerance
) -> RoundingVerdict:
    """Whether the second of two low-precision steps is within rounding of the first.

    ``twin`` is the first step in float32 compute, from the same parameters. Accepted
    when each leaf of the second step outside ``tolerance`` is within rounding of the
    first (:func:`~conformance.core.rounding.within_rounding`: no farther from it in
    relative L2 than twice the first's own distance from ``twin``). Updated parameters
    are compared where Adam's direction is not decided by the gradients' own difference
    (:func:`~conformance.runtime.diagnose.attribution.noise_masked` with ``sign_noise``).
    """
    first, twin_tree = step_tree(steps[0]), step_tree(twin)
    second = noise_masked(first, step_tree(steps[1]), sign_noise=True)[0]
    judged = []
    for path in sorted(m.path for m in compare_trees(first, second, tolerance)):
        if not all(path in tree for tree in (first, second, twin_tree)):
            judged.append((float("inf"), path, RoundingVerdict(False, "not in both steps")))
            continue
        rounding = relative_l2(first[path], twin_tree[path])
        closeness = relative_l2(second[path], first[path]) / max(rounding, np.finfo(float).tiny)
        verdict = within_rounding(first[path], second[path], twin_tree[path])
        judged.append((closeness, path, verdict))
    rejected = [f"{path}: {v.text}" for _, path, v in judged if not v.accepted]
    if rejected:
        return _beyond_rounding("of the leaves beyond tolerance", rejected)
    _, path, worst = max(judged, default=(0.0, "", RoundingVerdict(True, "")))
    return RoundingVerdict(
        True,
        f"of {len(judged)} leaf(s) beyond tolerance, the nearest its bound is {path}: {worst.text}",
    )


def rounding_step(
    case: Case, float_case: Case, start: Flat
) -> Callable[[int, tuple[StepResult, StepResult]], RoundingVerdict]:
    """A judge of quantized train steps from ``start`` that fail the float policy.

    ``judge(i, steps)`` is :func:`~conformance.core.rounding.rounding_verdict` of step
    ``i``'s two results, from the float steps of ``float_case`` and the quantized steps
    from ``start`` nudged by one ulp (both computed once, on the first call). Only the
    nudge bound applies: the sides' gradient errors against float spread too much on
    correct pairs (up to 4.8 % per leaf) to tell a side that quantizes differently (4 %
    to 17 %); the quantized forward checks tell it.
    """

    @functools.cache
    def floats() -> list[tuple[StepResult, ...]]:
        return train_steps(float_case, start)[1]

    @functools.cache
    def nudged() -> list[list[tuple[StepResult, ...]]]:
        return [train_steps(case, one_ulp_nudge(start, seed))[1] for seed in STEP_NUDGE_SEEDS]

    def judge(index: int, steps: tuple[StepResult, StepResult]) -> RoundingVerdict:
        def moved() -> tuple[list[Flat], list[Flat]]:
            runs = [run[index] for run in nudged()]
            return [step_tree(r[0]) for r in runs], [step_tree(r[1]) for r in runs]

        quantized = (step_tree(steps[0]), step_tree(steps[1]))
        twin = floats()[index]
        return rounding_verdict(
            "train steps",
            quantized,
            (step_tree(twin[0]), step_tree(twin[1])),
            moved,
            ("Linen", "NNX"),
            (),
        )

    return judge
