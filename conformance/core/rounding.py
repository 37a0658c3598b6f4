"""The quantization-aware policy: when a quantized disagreement is float rounding, carried.

Quantization turns a rounding-level difference between two float programs into whole
quantization steps: a value on a rounding boundary of the grid lands on one side of it
in one program and on the other side in the other. Two correctly written sides whose
float programs differ by rounding (another sum order, another attention kernel) then
disagree quantized far beyond the float tolerance, while quantizing alike.

A quantized comparison that fails the float policy is judged by its float twin (the same
computation from the same parameters, unquantized), in one of three regimes:

- the float results disagree beyond the float policy: a float divergence, reported as one;
- the float results are bitwise equal: nothing was there for quantization to amplify, so
  the sides quantize differently (a rule, a scale or its axes, a layer left float);
- the float results differ by rounding only: the disagreement is accepted when, leaf by
  leaf, it is at most :data:`SENSITIVITY_FACTOR` times either side's own movement when its
  float parameters are nudged by one ulp (:func:`one_ulp_nudge`), and when the two sides'
  errors against their own float results are equal within :data:`ERROR_SPREAD`. A side
  that quantizes less or more than the other changes its error against float; a rounding
  difference does not.

Measured on the built-in llama (mesh data=2,fsdp=2,tensor=2, relative L2 of logits): a
correct NNX side with ``jax.nn.dot_product_attention`` differs from Linen by 1.2e-2
(ptq_int8, qat_int8) while a one-ulp nudge moves each side by 2.3e-2, and the errors
against float differ by at most 0.4 %; the planted fault that quantizes only NNX's first
block moves logits by 1.0e-2 but its errors against float differ by 12.7 to 14.3 %.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from conformance.core.distributed import host_array
from conformance.core.numerics import EXACT, compare_trees, tolerance_for

ERROR_SPREAD = 0.02
"""The most two sides' errors against their own float results may differ in the rounding
regime, relative to the larger of the two (measured: 0.4 % on correct pairs, 12.7 % and
more with one of two blocks left unquantized)."""

RECORDED_ERROR_SPREAD = 0.08
""":data:`ERROR_SPREAD` against a recording, which may come from another machine: its
float and quantized runs round as that machine's compiler does. Measured: 4.4 % on
maxtext-deepseek3's correct qat_int8 forward (recorded on an AMD machine, live on an Intel
one); 12.7 % and more with one of two blocks left unquantized."""

NUDGE_SEEDS = (0, 1)
"""Nudges per side; a side's sensitivity is its largest movement over them."""

STEP_NUDGE_SEEDS = (0, 1, 2, 3)
"""Nudges per side for quantized train steps, whose rounding compounds over steps: with
two, a correct pair (llama with ``jax.nn.dot_product_attention``, three ``qat_int8``
steps, on an AMD EPYC with AVX-512) was 1.14x the bound; with four it passes."""

SENSITIVITY_FACTOR = 2.0
"""How many times a computation's measured sensitivity (its largest movement under the
nudges, relative L2 per leaf) a leaf's disagreement may be. Two nudges only estimate the
movement rounding can cause: on correct pairs the disagreement was 0.5x of it for logits
and up to 1.14x for one of 63 train-state leaves after three QAT steps."""


def relative_l2(first: Any, second: Any) -> float:
    """``||first - second|| / ||second||`` in float64.

    0 when both are zero, inf when only ``second`` is.
    """
    a, b = (np.asarray(host_array(x), np.float64) for x in (first, second))
    difference, scale = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
    if difference == 0.0:
        return 0.0
    return difference / scale if scale else float("inf")


def one_ulp_nudge(flat: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """``flat`` on the host with every floating-point element moved by one ulp.

    Each element moves up or down at random (from ``seed``); integer leaves are unchanged.
    Every floating dtype jax has moves, bfloat16 and the float8 types included (toward the
    dtype's largest finite value, not infinity, which some float8 types lack).
    The nudged values are as far from the originals as two float programs that round
    differently are from each other, so what a quantized program does with them is what
    rounding alone can do.
    """
    rng = np.random.default_rng(seed)
    nudged = {}
    for path, value in sorted(flat.items()):
        array = np.asarray(host_array(value))
        if jnp.issubdtype(array.dtype, jnp.floating):
            up = rng.random(array.shape) < 0.5
            finfo = jnp.finfo(array.dtype)
            target = np.where(up, finfo.max, finfo.min).astype(array.dtype)
            array = np.nextafter(array, target)
        nudged[path] = array
    return nudged


def nudge_covered(
    expected: Mapping[str, Any], actual: Mapping[str, Any], moved: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, Any], int]:
    """``actual`` with the disagreements that rounding alone explains taken from ``expected``.

    ``moved`` holds the computation of ``expected`` run again from its inputs nudged by one
    ulp (:func:`one_ulp_nudge`, one tree per seed). In a leaf that fails the policy, and
    is no farther from ``expected`` in relative L2 than :data:`SENSITIVITY_FACTOR` times
    the farthest nudged run, an element outside tolerance is covered when it lies between
    ``expected`` and the nudged runs there (widened by the tolerance): where a one-ulp
    nudge already moves the result. Covered elements are replaced by the expected value,
    so a later comparison counts only the rest; non-finite values are never covered.
    Returns the adjusted tree and how many elements it covered.
    """
    adjusted, covered = dict(actual), 0
    for found in compare_trees(expected, actual):
        runs = [host_array(run[found.path]) for run in moved if found.path in run]
        if found.path not in expected or found.path not in actual or not runs:
            continue
        e, a = host_array(expected[found.path]), host_array(actual[found.path])
        tol = tolerance_for(e.dtype, a.dtype)
        if tol == EXACT or any(np.shape(x) != np.shape(e) for x in [a, *runs]):
            continue
        if relative_l2(a, e) > SENSITIVITY_FACTOR * max(relative_l2(r, e) for r in runs):
            continue
        e64, a64 = np.asarray(e, np.float64), np.asarray(a, np.float64)
        runs64 = np.stack([np.asarray(r, np.float64) for r in runs])
        slack = tol.atol + tol.rtol * np.abs(a64)
        with np.errstate(invalid="ignore"):
            low = np.minimum(e64, runs64.min(axis=0)) - slack
            high = np.maximum(e64, runs64.max(axis=0)) + slack
            finite = np.isfinite(a64) & np.isfinite(low) & np.isfinite(high)
            take = finite & (np.abs(a64 - e64) > slack) & (low <= a64) & (a64 <= high)
        covered += int(take.sum())
        adjusted[found.path] = np.where(take, e, a).astype(a.dtype)
    return adjusted, covered


@dataclasses.dataclass(frozen=True)
class RoundingVerdict:
    """What the float twin of a failed quantized comparison says, in words."""

    accepted: bool
    """The disagreement is float rounding carried across quantization steps."""
    text: str


def _joined(flat: Mapping[str, Any], prefixes: Sequence[str]) -> np.ndarray:
    leaves = [
        np.asarray(host_array(v), np.float64).ravel()
        for p, v in sorted(flat.items())
        if p.startswith(tuple(prefixes))
    ]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def _bitwise(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    return first.keys() == second.keys() and all(
        np.array_equal(host_array(first[p]), host_array(second[p]), equal_nan=True) for p in first
    )


def twins_disagree(
    what: str, twins: tuple[Mapping[str, Any], Mapping[str, Any]], carried: str
) -> RoundingVerdict | None:
    """A verdict rejecting a low-precision disagreement whose float ``twins`` disagree too.

    ``None`` when the twins agree within the float policy; else ``"the <what> disagree
    too (<count and worst leaf>): <carried>"``.
    """
    mismatches = compare_trees(*twins)
    if not mismatches:
        return None
    worst = max(mismatches, key=lambda m: m.max_abs)
    return RoundingVerdict(
        False,
        f"the {what} disagree too ({len(mismatches)} leaf(s) beyond the float policy, worst "
        f"{worst.path} by {worst.max_abs:.3e}): {carried}",
    )


def rounding_verdict(
    what: str,
    quantized: tuple[Mapping[str, Any], Mapping[str, Any]],
    floats: tuple[Mapping[str, Any], Mapping[str, Any]],
    moved: Callable[[], tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]],
    names: tuple[str, str],
    error_leaves: Sequence[str],
    error_spread: float = ERROR_SPREAD,
) -> RoundingVerdict:
    """Whether two quantized results that fail the float policy differ by rounding only.

    ``quantized`` and ``floats`` are both sides' results (flat trees with the same paths)
    quantized and unquantized from the same parameters; ``moved()`` gives each side's
    quantized results from its float parameters nudged by one ulp (one tree per nudge;
    called only in the rounding regime). ``error_leaves`` are the path prefixes whose
    error against float measures how much each side quantized (logits; gradients); empty,
    the errors are not compared (a later train step, whose float twin has drifted away
    from the quantized run). They may differ by ``error_spread`` of the larger.
    """
    a, b = names
    carried = "a float divergence that quantization carries, not a quantization one"
    if (disagree := twins_disagree(f"float {what}", floats, carried)) is not None:
        return disagree
    if _bitwise(*floats):
        return RoundingVerdict(
            False,
            f"the float {what} agree bitwise, so nothing was there for quantization to "
            f"amplify: {a} and {b} quantize differently (a rule, a scale or its axes, a "
            "layer left in float)",
        )
    errors = [
        relative_l2(_joined(q, error_leaves), _joined(f, error_leaves)) if error_leaves else 0.0
        for q, f in zip(quantized, floats, strict=True)
    ]
    spread = abs(errors[0] - errors[1]) / max(max(errors), np.finfo(np.float64).tiny)
    nudges = moved()
    beyond, worst = [], (0.0, 0.0, "")
    for path in sorted(quantized[0]):
        difference = relative_l2(quantized[1][path], quantized[0][path])
        sensitivity = SENSITIVITY_FACTOR * max(
            relative_l2(run[path], side[path])
            for side, runs in zip(quantized, nudges, strict=True)
            for run in runs
        )
        if difference > sensitivity:
            beyond.append(f"{path}: {difference:.3e} apart, bound {sensitivity:.3e}")
        if difference >= worst[0]:
            worst = (difference, sensitivity, path)
    figures = (
        f"the float {what} differ by rounding only (within the float policy, not bitwise). "
        f"Quantized, {worst[2]} is {worst[0]:.3e} apart (relative L2); its bound is "
        f"{worst[1]:.3e}, {SENSITIVITY_FACTOR:g}x the most a one-ulp nudge of either side's "
        "float parameters moves it"
    )
    if error_leaves:
        figures += (
            f"; the errors against float are {a} {errors[0]:.4g} and {b} {errors[1]:.4g} "
            f"(spread {spread:.1%}, at most {error_spread:.0%})"
        )
    if spread > error_spread:
        return RoundingVerdict(
            False,
            f"{figures}: the sides are not equally far from float, so one quantizes more "
            "than the other",
        )
    if beyond:
        more = f"; and {len(beyond) - 5} more" if len(beyond) > 5 else ""
        listed = "; ".join(beyond[:5]) + more
        return RoundingVerdict(
            False,
            f"{figures}: {len(beyond)} leaf(s) differ more than rounding moves them: {listed}",
        )
    return RoundingVerdict(True, f"{figures}: float rounding carried by quantization, accepted")


LOW_PRECISION_FACTOR = 2.0
"""How many times a low-precision reference computation's distance from its float32 twin
(relative L2) another low-precision computation of the same values may be from it: two
computations that each round that far differ by up to about twice as much."""


def within_rounding(expected: Any, actual: Any, twin: Any) -> RoundingVerdict:
    """Whether low-precision ``actual`` is as close to ``expected`` as rounding leaves it.

    ``expected`` is the reference computation in the low precision (bfloat16), ``twin``
    the same computation in float32. Accepted when both are finite and ``actual`` is at
    most :data:`LOW_PRECISION_FACTOR` times ``expected``'s own distance from ``twin``
    away from ``expected`` (relative L2): a computation that is wrong moves farther than
    rounding does, one that rounds in another order does not.
    """
    if not (np.isfinite(host_array(expected)).all() and np.isfinite(host_array(actual)).all()):
        return RoundingVerdict(False, "not finite, so not rounding")
    apart, rounding = relative_l2(actual, expected), relative_l2(expected, twin)
    bound = LOW_PRECISION_FACTOR * rounding
    figures = (
        f"{apart:.3e} apart (relative L2); the bound is {bound:.3e}, "
        f"{LOW_PRECISION_FACTOR:g}x the reference's own {rounding:.3e} from its float32 twin"
    )
    if apart > bound:
        return RoundingVerdict(False, f"{figures}: farther than rounding moves it")
    return RoundingVerdict(True, f"{figures}: rounding, accepted")


def pair_within_rounding(
    what: str, pair: tuple[Any, Any], twins: tuple[Any, Any]
) -> RoundingVerdict:
    """Whether two low-precision results (Linen's, NNX's) differ by rounding only.

    ``twins`` are the same two computations in float32. Accepted when the twins agree
    within the float32 policy (:func:`twins_disagree`, naming them ``float32 <what>``)
    and the second result is :func:`within_rounding` of the first, against its twin.
    """
    carried = "a divergence the lower precision carries, not rounding"
    floats = ({"logits": twins[0]}, {"logits": twins[1]})
    return twins_disagree(f"float32 {what}", floats, carried) or within_rounding(*pair, twins[0])
