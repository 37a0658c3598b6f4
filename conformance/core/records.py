"""Measurements a check leaves behind: how close two sides came, passing or not.

A check's verdict is pass or fail; a report also wants the numbers behind it (a check
passing at 1e-12 and one passing at 9e-6 of a 1e-5 bound are not the same news). Checks
:func:`emit` one :class:`Measurement` per comparison they make; whoever runs them
(the pytest plugin, per test) collects them with :func:`collecting`. Outside
``collecting`` an emitted measurement goes nowhere, so checks cost nothing extra when
nobody listens.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from conformance.core.distributed import host_array
from conformance.core.numerics import Mismatch, Tolerance, report, tolerance_for


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One comparison as numbers: its worst errors and how much of the bound they use.

    ``used`` is the largest ``|a - b| / (atol + rtol * |b|)`` over the elements: above
    1 the comparison fails, and ``1 / used`` is the headroom a passing one has. A plot
    draws the measurements of one ``figure``, one line per ``series``, along ``x``.
    """

    title: str
    names: tuple[str, str]
    max_abs: float
    max_rel: float
    used: float
    tolerance: Tolerance
    figure: str = ""
    series: str = ""
    x: str = ""
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether the comparison agreed.

        ``used`` may pass 1 on an agreeing one where the policy's reference tie-break
        accepted an element.
        """
        return not self.mismatches


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one compiled program costs on each side: a row group of a report's cost table.

    ``sides`` maps a side's name to its cost as plain values
    (:meth:`conformance.core.cost.Cost.table`).
    """

    program: str
    sides: dict[str, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Layouts:
    """How one compiled program lays out each module call's values (activation table)."""

    program: str
    rows: tuple[tuple[str, str, str], ...]
    """Per call of the second side (NNX, or a mode): ``(call, its output layouts, the first
    side's where they differ, else "")``."""


Record = Measurement | Costs | Layouts
"""What a check can leave behind for a report."""

_SINK: contextvars.ContextVar[list[Record] | None] = contextvars.ContextVar(
    "conformance_measurements", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[list[Record]]:
    """Collect every record emitted inside the block into the yielded list."""
    found: list[Record] = []
    token = _SINK.set(found)
    try:
        yield found
    finally:
        _SINK.reset(token)


def listening() -> bool:
    """Whether an emitted measurement is collected (checks may skip measuring if not)."""
    return _SINK.get() is not None


def emit(record: Record) -> None:
    """Hand ``record`` to the innermost :func:`collecting` block, if any."""
    sink = _SINK.get()
    if sink is not None:
        sink.append(record)


def error_stats(first: Any, second: Any, tolerance: Tolerance) -> tuple[float, float, float]:
    """``(max |a-b|, max |a-b|/|b|, used)`` of two same-shape arrays under ``tolerance``.

    Non-finite elements count as infinitely wrong unless both sides hold the same one;
    elements where ``b`` is 0 have no relative error. ``used`` is defined on
    :class:`Measurement`.
    """
    a = host_array(first).astype(np.float64)
    b = host_array(second).astype(np.float64)
    if a.shape != b.shape or a.size == 0:
        return (math.inf, math.inf, math.inf) if a.shape != b.shape else (0.0, 0.0, 0.0)
    finite = np.isfinite(a) & np.isfinite(b)
    same = ~finite & ((a == b) | (np.isnan(a) & np.isnan(b)))
    if (~finite & ~same).any():
        return math.inf, math.inf, math.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.where(finite, np.abs(a - b), 0.0)
        rel = np.where(finite & (b != 0), diff / np.abs(b), 0.0)
        bound = tolerance.atol + tolerance.rtol * np.abs(b)
        used = np.where(diff == 0, 0.0, np.where(bound > 0, diff / bound, np.inf))
    return float(diff.max()), float(rel.max()), float(used.max())


def measure(
    title: str,
    first: dict[str, Any],
    second: dict[str, Any],
    mismatches: tuple[Mismatch, ...] | list[Mismatch] = (),
    *,
    names: tuple[str, str] = ("Linen", "NNX"),
    tolerance: Tolerance | None = None,
    figure: str = "",
    series: str = "",
    x: str = "",
) -> Measurement:
    """The :class:`Measurement` of two flat trees (the leaves both have), worst leaf wins.

    ``mismatches`` are the comparison's failures, kept as they were found. Each leaf is
    measured under ``tolerance``, or the policy for its dtypes; the measurement's own
    tolerance is the loosest one applied.
    """
    worst = (0.0, 0.0, 0.0)
    applied: list[Tolerance] = []
    for path in sorted(set(first) & set(second)):
        a, b = host_array(first[path]), host_array(second[path])
        tol = tolerance or tolerance_for(a.dtype, b.dtype)
        applied.append(tol)
        stats = error_stats(a, b, tol)
        worst = tuple(max(w, s) for w, s in zip(worst, stats, strict=True))
    loosest = max(applied, key=lambda t: (t.rtol, t.atol)) if applied else Tolerance(0.0, 0.0)
    return Measurement(
        title, names, *worst, tolerance or loosest, figure, series, x, tuple(mismatches)
    )


def emit_verdict(
    title: str,
    path: str,
    first: Any,
    second: Any,
    found: Mismatch | None,
    *,
    names: tuple[str, str] = ("Linen", "NNX"),
    tolerance: Tolerance | None = None,
    figure: str = "",
    series: str = "",
    x: str = "",
) -> None:
    """Emit the measurement of two arrays a check has already judged (``found``: its verdict).

    For a comparison whose verdict is not the plain policy's (one decided against a
    wider reference), so the measurement keeps the check's own verdict.
    """
    if listening():
        trees = {path: first}, {path: second}
        mismatches = [found] if found else []
        where = {"figure": figure, "series": series, "x": x}
        emit(measure(title, *trees, mismatches, names=names, tolerance=tolerance, **where))


def failed(
    title: str, mismatches: list[Mismatch], names: tuple[str, str] = ("Linen", "NNX")
) -> str:
    """:func:`~conformance.core.numerics.report`'s failure text; emits the failing comparison.

    For checks that measure nothing while passing: the measurement holds the
    mismatches, and its errors are the worst mismatching leaf's (``used`` at that
    leaf's worst element).
    """
    used = max((_used_at_worst(m) for m in mismatches), default=math.inf)
    emit(
        Measurement(
            title,
            names,
            max((m.max_abs for m in mismatches), default=math.inf),
            max((m.max_rel for m in mismatches if not math.isnan(m.max_rel)), default=math.nan),
            used,
            max(
                (m.tolerance for m in mismatches),
                key=lambda t: (t.rtol, t.atol),
                default=Tolerance(0.0, 0.0),
            ),
            mismatches=tuple(mismatches),
        )
    )
    return report(title, mismatches, names)


def _used_at_worst(m: Mismatch) -> float:
    if m.missing_on is not None or m.shapes is not None:
        return math.inf
    bound = m.tolerance.atol + m.tolerance.rtol * abs(m.second)
    diff = abs(m.first - m.second)
    return diff / bound if bound > 0 else (math.inf if diff else 0.0)
