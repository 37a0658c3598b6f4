"""Forward parity: logits agree after transplanting parameters in both directions.

On a failure the report names the first module, in call order, whose inputs agree and
whose output diverges (:mod:`conformance.runtime.diagnose.localise`), and which side
moves when the forward runs on one device.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import (
    attribution_text,
    forward_attribution,
    paired,
    precision_differences,
    within_spread,
)
from conformance.contract import Batch, PathRules, accepted_precision
from conformance.core.distributed import host_array
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import (
    Mismatch,
    Tolerance,
    compare_arrays,
    compare_trees,
    report,
    tolerance_for,
)
from conformance.core.records import emit, emit_verdict, listening, measure
from conformance.core.rounding import RoundingVerdict, pair_within_rounding
from conformance.runtime.case import Case
from conformance.runtime.diagnose.localise import Divergence, localise
from conformance.runtime.sides import Side, live_pair, live_sides


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """Logits and sown per-block hidden states of one side."""

    logits: jax.Array
    hidden: jax.Array | None


_NOT_SOWN = "per-block hidden states are not sown on both sides (an optional shortcut)"


def _first_divergent_block(
    first: ForwardResult, second: ForwardResult, tol: Any, names: tuple[str, str]
) -> str | None:
    """Localisation from the sown ``hidden_states``, when both sides (``names``) sow them."""
    if first.hidden is None or second.hidden is None:
        return None
    for layer in range(first.hidden.shape[0]):
        found = compare_arrays(
            f"hidden_states[{layer}]", first.hidden[layer], second.hidden[layer], tol
        )
        if found is not None:
            return f"first divergent block: {layer} (output of decoder block {layer})\n  " + (
                found.describe(names)
            )
    return (
        "every block's output agrees: the divergence is after the last block (final norm or head)"
    )


def _measure_forward(
    title: str,
    results: tuple[ForwardResult, ForwardResult],
    names: tuple[str, str],
    tol: Tolerance,
    found: Mismatch | None,
) -> None:
    """Emit each block's hidden-state error (when both sides sow them), then the logits'."""
    if not listening():
        return
    a, b = results
    figure = f"forward: error per decoder block ({a.logits.dtype})"

    def where(x: str) -> dict[str, Any]:
        return {"figure": figure, "series": title, "x": x, "names": names}

    if a.hidden is not None and b.hidden is not None and a.hidden.shape == b.hidden.shape:
        for i in range(a.hidden.shape[0]):
            trees = {f"hidden_states[{i}]": a.hidden[i]}, {f"hidden_states[{i}]": b.hidden[i]}
            mismatches = compare_trees(*trees, tol)
            x = f"block {i}"
            emit(measure(f"{title}: {x}", *trees, mismatches, tolerance=tol, **where(x)))
    # The logits' verdict is the check's own (it may have used a wider reference).
    emit_verdict(
        f"{title}: logits", "logits", a.logits, b.logits, found, tolerance=tol, **where("logits")
    )


@declare((*ON_MESH, Axis.DTYPE, Axis.PAIR))
def check_forward(case: Case) -> None:
    """Logits agree after transplanting parameters both ways between the case's two sides.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis).
    Tolerance follows the policy for the case's compute dtype. A failure names the first
    divergent module, which side moves when partitioned, and any module that computes in
    other dtypes on each side (the ``precision`` check's profile). Below float32, an element
    outside tolerance passes when the second side is no farther than the first from the
    first's float32 result from the same parameters (the policy's tie-break), and logits
    pass when the sides agree on one device and each moves on the mesh by as much as they
    differ (rounding inside two partitioned programs, see ``docs/tolerances.md``), or when
    the float32 forwards agree and the second side is within rounding of the first
    (:func:`_rounding`).
    """
    first, second = live_pair(case)
    paired(first, second)
    names, batch = (first.name, second.name), case.batch()
    first_own, second_own = first.init(0), second.init(1)
    directions = {
        f"{first.name} params -> {second.name}": (first_own, second.receive(first_own, first)),
        f"{second.name} params -> {first.name}": (first.receive(second_own, second), second_own),
    }
    compared = []
    lower = case.dtype != jnp.float32
    for direction, (first_params, second_params) in directions.items():
        a = ForwardResult(*first.forward(first_params, batch))
        b = ForwardResult(*second.forward(second_params, batch))
        tol = tolerance_for(a.logits.dtype)
        found = compare_arrays("logits", a.logits, b.logits, tol)
        moved, rounding = None, None
        twins = (first_params, second_params)
        if found is not None and lower:
            twins = tuple(
                side.forward(params, batch)[0]
                for side, params in zip(live_pair(case.in_dtype(jnp.float32)), twins, strict=True)
            )
            found = compare_arrays("logits", a.logits, b.logits, tol, reference=twins[0])
        if found is not None and lower:
            params = (first_params, second_params)
            moved = forward_attribution(first, second, (a.logits, b.logits), params)
            found = None if within_spread(moved) else found
        if found is not None and lower:
            rounding = _rounding((a.logits, b.logits), twins)
            found = None if rounding.accepted else found
        _measure_forward(f"{direction} on mesh {case.mesh.id}", (a, b), names, tol, found)
        compared.append((direction, first_params, second_params, a, b, tol, found, moved, rounding))
    # Both directions are measured first; the first that disagrees is the verdict.
    for direction, first_params, second_params, a, b, tol, found, moved, rounding in compared:
        if found is None:
            continue
        rules = first.path_rules()
        found_module = localise(
            first.runner,
            second.runner,
            first_params,
            second_params,
            batch,
            first.leaf_map().pairs(),
            rules,
        )
        divergence = isinstance(found_module, Divergence)
        where = found_module.describe(names) if divergence else found_module
        if not divergence or found_module.unpaired_inside:
            where += "\n  " + (_first_divergent_block(a, b, tol, names) or _NOT_SOWN)
        if moved is None:  # float32: attributed only now, for the direction that fails
            params = (first_params, second_params)
            moved = forward_attribution(first, second, (a.logits, b.logits), params)
        fail(
            report(f"{direction} on mesh {case.mesh.id}", [found], names)
            + f"\n  {where}\n  {attribution_text(moved)}"
            + ("" if rounding is None else f"\n  bfloat16 rounding: {rounding.text}")
            + _precision_note(case, first, second, batch, rules)
        )


def _rounding(logits: tuple[Any, Any], twins: tuple[Any, Any]) -> RoundingVerdict:
    """Whether the two sides' low-precision ``logits`` differ by rounding only.

    ``twins`` are the same forwards in float32 compute. Accepted when the twins agree
    within the float32 policy and the second side is within rounding of the first
    (:func:`~conformance.core.rounding.within_rounding`, against the first's float32 logits).
    """
    return pair_within_rounding("forwards", logits, twins)


def _precision_note(case: Case, first: Side, second: Side, batch: Batch, rules: PathRules) -> str:
    """A line per module the sides compute in other dtypes; never a second failure."""
    accepted = accepted_precision(case.family)
    try:
        changes = precision_differences(first, second, batch, rules, accepted)[0]
    except Exception as err:  # the note is advice: a failure is already being reported
        reason = re.sub(r"\s+", " ", str(err))[:300]
        return f"\n  precision profiles could not be traced ({type(err).__name__}: {reason})"
    names = (first.name, second.name)
    return "".join(f"\n  precision differs: {change.describe(names)}" for change in changes)


def unusable(logits: np.ndarray) -> np.ndarray:
    """Where ``logits`` (``[..., vocab]``) cannot be a model's output: True per element.

    NaN and ``+inf`` anywhere, and every element of a position whose logits are all
    ``-inf`` (its softmax is NaN). A ``-inf`` beside finite logits is a masked entry (a
    padded vocabulary, say) and passes.
    """
    dead = np.all(np.isneginf(logits), axis=-1, keepdims=True)
    return np.isnan(logits) | np.isposinf(logits) | np.broadcast_to(dead, logits.shape)


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="primary", pair=False)
def check_finite(case: Case) -> None:
    """Every live side's logits from its own initial parameters are usable (:func:`unusable`).

    A comparison agrees where both sides give the same non-finite value, so a fault the
    sides share (a layer both import, a config field both read) passes it; this check
    names each side with NaN, ``+inf`` or all-``-inf`` logits, how many, and the first index.
    """
    batch = case.batch()
    sides = live_sides(case)
    found = []
    for side in sides:
        logits = host_array(side.forward(side.init(), batch)[0])
        if (bad := unusable(logits)).any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            found.append(
                f"{side.name} logits: {int(bad.sum())} of {bad.size} non-finite, "
                f"first at index {first}: {logits[first]}"
            )
    if found and len(found) == len(sides) > 1:
        found.append(
            "likely cause: something every side shares (a shared layer, the config, the "
            "batch), not a Linen/NNX divergence"
        )
    elif found and len(sides) > 1:
        found.append("likely cause: a divergence of that side alone (see the forward check)")
    fail_if_any(f"non-finite logits on mesh {case.mesh.id}", found)
