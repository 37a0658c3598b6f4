"""Logits compared: two sides' forwards, their quantized forwards, and which side moved.

:func:`compared` is the comparison every logits check makes; when it fails on a mesh,
:func:`forward_attribution` reruns both forwards on one device to say which side
computes differently when partitioned. Quantized forwards are judged with the float
forwards beside them (:func:`quantized_forwards`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.core.distributed import host_array
from conformance.core.failure import fail
from conformance.core.numerics import Mismatch, Tolerance, compare_arrays, report
from conformance.core.records import emit_verdict
from conformance.core.rounding import (
    ERROR_SPREAD,
    NUDGE_SEEDS,
    one_ulp_nudge,
    relative_l2,
    rounding_verdict,
)
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.diagnose.attribution import (
    Attribution,
    Pair,
    attribution_of,
    attribution_text,
)
from conformance.runtime.sides import Side


def compared(
    title: str,
    first: Any,
    second: Any,
    *,
    names: tuple[str, str] = ("Linen", "NNX"),
    tolerance: Tolerance | None = None,
    figure: str = "",
    series: str = "",
    x: str = "",
    judge: Callable[[Mismatch], bool] | None = None,
) -> Mismatch | None:
    """Two sides' logits compared under the policy (or ``tolerance``), and measured.

    The comparison every logits check makes: :func:`~conformance.core.numerics.compare_arrays`
    of the leaf ``logits``, emitted as a measurement titled ``title`` (at ``x`` of line
    ``series`` in plot ``figure``) for the report. A mismatch that ``judge`` accepts (a
    low-precision one within rounding) is measured and returned as agreeing. Returns the
    mismatch, if any.
    """
    found = compare_arrays("logits", first, second, tolerance)
    if found is not None and judge is not None and judge(found):
        found = None
    plot = {"figure": figure, "series": series, "x": x}
    emit_verdict(title, "logits", first, second, found, names=names, tolerance=tolerance, **plot)
    return found


def attributed(
    case: Case,
    names: tuple[str, str],
    on_mesh: Pair,
    on_one_device: Callable[[], Pair],
    *,
    quantized: bool = False,
) -> str:
    """Which of two results computed on ``case``'s mesh moves on one device, in words.

    ``on_one_device`` recomputes both on one device (only called here, after a
    failure); never raises (:func:`~conformance.runtime.diagnose.attribution.attribution_of`).
    """
    found = attribution_of(case.mesh, names, on_mesh, on_one_device, quantized=quantized)
    return attribution_text(found)


def forward_attribution(
    first: Side,
    second: Side,
    logits: tuple[Any, Any],
    params: tuple[Flat, Flat],
    *,
    quantized: bool = False,
) -> Attribution | str:
    """Which side's ``logits`` on the case's mesh move when the forward runs on one device.

    ``logits`` come from ``params`` (each side's own paths); both forwards are rerun
    from the same parameters on the sides' one-device references, so call it only on a
    failure. ``quantized`` (implied by a quantized case): the forward rounds to a grid.
    The attribution, or why there is none (the one-device run failed).
    """

    def on_one_device() -> Pair:
        results = []
        for side, side_params in zip((first, second), params, strict=True):
            reference = side.reference()
            batch = reference.case.batch()
            results.append({"logits": reference.forward(reference.place(side_params), batch)[0]})
        return results[0], results[1]

    on_mesh = ({"logits": logits[0]}, {"logits": logits[1]})
    quantized = quantized or first.case.quant is not None
    names = (first.name, second.name)
    return attribution_of(first.case.mesh, names, on_mesh, on_one_device, quantized=quantized)


def within_spread(found: Attribution | str) -> bool:
    """Whether an attribution shows a gap that partitioning alone explains.

    :attr:`~conformance.runtime.diagnose.attribution.Attribution.within_spread`: the
    sides agree on one device and each moves on the mesh by as much as they differ. The
    quantized forwards and the bfloat16 ``forward`` pass then; an unquantized float32
    forward does not ask.
    """
    return isinstance(found, Attribution) and found.within_spread


Rerun = Callable[[Flat], Any]
"""A side's quantized computation from float parameters given on the host (own paths)."""


def nudged_reruns(
    reruns: tuple[Rerun | None, Rerun | None], float_params: tuple[Flat | None, Flat | None]
) -> tuple[list[Any], list[Any]]:
    """Each side's quantized results from its float parameters nudged by one ulp.

    One result per seed of :data:`~conformance.core.rounding.NUDGE_SEEDS`: the same
    programs as the compared run, so nothing new is compiled. A side without a rerun (a
    recording) has none.
    """
    first, second = (
        []
        if rerun is None or params is None
        else [rerun(one_ulp_nudge(params, seed)) for seed in NUDGE_SEEDS]
        for rerun, params in zip(reruns, float_params, strict=True)
    )
    return first, second


def quantized_forwards(
    title: str,
    names: tuple[str, str],
    logits: tuple[Any, Any],
    float_logits: tuple[Any, Any],
    reruns: tuple[Rerun | None, Rerun | None],
    float_params: tuple[Flat | None, Flat | None],
    attribution: Callable[[], Attribution | str] | None = None,
    error_spread: float = ERROR_SPREAD,
) -> str | None:
    """The report of two quantized forwards disagreeing under the quantization-aware policy.

    ``logits`` must agree under the float policy, or differ by float rounding carried
    across quantization steps (:func:`~conformance.core.rounding.rounding_verdict`,
    judged from the ``float_logits`` of the same parameters and each side's ``reruns``
    from nudged ``float_params``; a side that cannot be rerun, a recording, gives
    ``None`` for both), or (given ``attribution``, the forwards on a mesh) differ by no
    more than partitioning moves each (:func:`within_spread`). A report says what the
    float forwards show and which side moved. ``error_spread``: how far the two sides'
    errors against float may differ (looser against a recording from another machine).
    """
    found = compare_arrays("logits", *logits)
    verdict = None
    if found is not None:

        def moved() -> tuple[list[Flat], list[Flat]]:
            first, second = nudged_reruns(reruns, float_params)
            return [{"logits": x} for x in first], [{"logits": x} for x in second]

        verdict = rounding_verdict(
            "forwards",
            ({"logits": logits[0]}, {"logits": logits[1]}),
            ({"logits": float_logits[0]}, {"logits": float_logits[1]}),
            moved,
            names,
            ("logits",),
            error_spread,
        )
    accepted = verdict is not None and verdict.accepted
    moved = None if found is None or accepted or attribution is None else attribution()
    accepted = accepted or (moved is not None and within_spread(moved))
    emit_verdict(title, "logits", *logits, None if accepted else found, names=names)
    if found is None or accepted:
        return None
    text = f"{report(title, [found], names)}\n  {verdict.text}"
    return text if moved is None else f"{text}\n  {attribution_text(moved)}"


def error_bound(where: str, quantized: Any, reference: Any, bound: float) -> None:
    """Quantized logits differ from float ``reference`` logits, by at most ``bound``.

    The measure is the relative L2 error ``||quantized - reference|| / ||reference||``;
    an error of exactly zero fails, as it means quantization did nothing.
    """
    q, r = (host_array(x).astype(np.float64) for x in (quantized, reference))
    error = float(np.linalg.norm(q - r) / max(np.linalg.norm(r), np.finfo(np.float64).tiny))
    if error == 0.0:
        fail(f"{where}: quantized logits equal the float logits exactly; quantization did nothing")
    if not error <= bound:
        fail(
            f"{where}: relative L2 error of quantized vs float logits is {error:.4g}, "
            f"above the bound {bound}"
        )


def beyond_own_spread(name: str, expected: Any, actual: Any, partitioned: Any, mesh: str) -> str:
    """Why ``actual`` is not within its own spread of ``expected``, as a line; ``""`` if it is.

    Within: finite, and no farther from ``expected`` in relative L2 than from
    ``partitioned``, the same computation partitioned on ``mesh``: rounding in another
    order (another machine's compiler, say) moves it that far. ``name`` names its side.
    """
    if not np.isfinite(host_array(actual)).all():
        return f"\n  not judged by rounding: {name}'s logits are not all finite"
    gap, reach = relative_l2(actual, expected), relative_l2(partitioned, actual)
    if gap <= reach:
        return ""
    return (
        f"\n  judged by rounding: {gap:.3e} from the recording (relative L2), more than the "
        f"{reach:.3e} {name} moves by itself partitioned on mesh {mesh}"
    )
