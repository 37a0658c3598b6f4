"""Tolerance policy and array/tree comparison with reports that name the failing leaf.

Two values agree when ``|a - b| <= atol + rtol * |b|`` (``b`` is the second side, as in
``torch.testing.assert_close``), compared in float64 after upcasting. A NaN or Inf agrees
only with the same non-finite value at the same index; it is never masked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from conformance.core.distributed import host_array


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance for one dtype."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g}"


EXACT = Tolerance(0.0, 0.0)

POLICY: Mapping[str, Tolerance] = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1e-5, 1.3e-6),
    "bfloat16": Tolerance(1e-5, 1.6e-2),
    "float16": Tolerance(1e-5, 1e-3),
}
"""The tolerance policy (docs/tolerances.md), by dtype name; integer and bool dtypes
compare exactly."""


def _policy(dtypes: Sequence[Any]) -> list[Tolerance]:
    return [POLICY.get(np.dtype(d).name, EXACT) for d in dtypes]


def _looseness(tolerance: Tolerance) -> tuple[float, float]:
    return tolerance.rtol, tolerance.atol


def tolerance_for(*dtypes: Any) -> Tolerance:
    """The policy's tolerance for comparing values of these dtypes: the loosest one wins."""
    return max(_policy(dtypes), key=_looseness)


def strictest_tolerance(*dtypes: Any) -> Tolerance:
    """The policy's tolerance for the most precise of these dtypes: the tightest one wins."""
    return min(_policy(dtypes), key=_looseness)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """How one leaf failed: enough to fix the bug from the message alone."""

    path: str
    index: tuple[int, ...]
    first: float
    second: float
    count: int
    size: int
    max_abs: float
    max_rel: float
    tolerance: Tolerance
    reason: str = ""
    zeros: int = 0
    """Differing elements where the second side is exactly 0: they have no relative
    error, so ``max_rel`` is over the others only (NaN if there are none)."""
    accepted: int = 0
    """Elements outside tolerance that the tie-break accepted (the second side no
    farther from the reference than the first); not counted in ``count``."""
    spread_covered: int = 0
    """Elements outside tolerance within the second side's own spread (the sides differ
    there by no more than the tolerance plus how far the second side moves when computed
    in another order); not counted in ``count``."""
    missing_on: int | None = None
    """0 or 1 when the leaf exists on the other side only; no values were compared."""
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """Both sides' shapes when they differ; no values were compared."""

    def describe(self, names: tuple[str, str] = ("Linen", "NNX")) -> str:
        """One paragraph: the leaf, the worst index, both values, the errors and tolerance.

        A leaf present on one side only, or of different shapes, is one line saying so.
        """
        a, b = names
        if self.missing_on is not None:
            absent, present = (a, b) if self.missing_on == 0 else (b, a)
            return f"{self.path}: {present} has this leaf, {absent} does not"
        if self.shapes is not None:
            first, second = (list(shape) for shape in self.shapes)
            return f"{self.path}: shape {first} on {a}, {second} on {b}"
        head = f"{self.path}: {self.count} of {self.size} elements differ"
        if self.reason:
            head += f" ({self.reason})"
        rel = "none" if np.isnan(self.max_rel) else f"{self.max_rel:.3e}"
        if self.zeros:
            rel += f" ({self.zeros} where {b} is exactly 0: no relative error there)"
        text = (
            f"{head}\n"
            f"    worst at index {list(self.index)}: {a}={self.first!r} {b}={self.second!r}\n"
            f"    over the {self.count} differing elements: max |a-b|={self.max_abs:.3e}  "
            f"max rel={rel}  tolerance {self.tolerance}"
        )
        if self.accepted:
            text += (
                f"\n    the tie-break accepted {self.accepted} more elements outside tolerance "
                f"({b} no farther from the reference than {a})"
            )
        if self.spread_covered:
            text += (
                f"\n    {self.spread_covered} more elements outside tolerance were within "
                f"{b}'s own spread (how far it moves when computed in another order)"
            )
        return text


def _as_f64(x: Any) -> np.ndarray:
    return np.asarray(host_array(x).astype(np.float64))


def compare_arrays(
    path: str,
    first: Any,
    second: Any,
    tolerance: Tolerance | None = None,
    reference: Any | None = None,
    spread: Any | None = None,
) -> Mismatch | None:
    """Compare two arrays elementwise; ``None`` if they agree, else the :class:`Mismatch`.

    ``tolerance`` defaults to the policy for the two dtypes. With ``reference`` (a more
    precise result of the same computation), an element outside tolerance is still
    accepted when the second side is no farther from the reference than the first one:
    the policy's tie-break for low-precision dtypes (docs/tolerances.md). With
    ``spread`` (the second side's result computed again in another order, such as
    partitioned), an element outside tolerance is accepted when the sides differ there
    by at most the tolerance plus ``|second - spread|``: by no more than the second side
    differs from itself (docs/tolerances.md).
    """
    a, b = host_array(first), host_array(second)
    tol = tolerance or tolerance_for(a.dtype, b.dtype)
    if a.shape != b.shape:
        return Mismatch(
            path,
            (),
            np.nan,
            np.nan,
            a.size,
            max(a.size, b.size),
            np.inf,
            np.inf,
            tol,
            shapes=(a.shape, b.shape),
        )
    a64, b64 = _as_f64(a), _as_f64(b)
    finite = np.isfinite(a64) & np.isfinite(b64)
    same_nonfinite = ~finite & ((a64 == b64) | (np.isnan(a64) & np.isnan(b64)))
    with np.errstate(invalid="ignore"):
        diff = np.where(finite, np.abs(a64 - b64), np.inf)
        outside = finite & (diff > tol.atol + tol.rtol * np.abs(b64))
    bad = outside | (~finite & ~same_nonfinite)
    accepted = 0
    if reference is not None and bad.any():
        ref = _as_f64(reference)
        farther = np.abs(b64 - ref) > np.abs(a64 - ref)
        accepted = int((bad & ~farther).sum())
        bad &= farther
    covered = 0
    if spread is not None and bad.any():
        own = np.abs(b64 - _as_f64(spread))
        with np.errstate(invalid="ignore"):
            within = finite & (diff <= tol.atol + tol.rtol * np.abs(b64) + own)
        covered = int((bad & within).sum())
        bad &= ~within
    if not bad.any():
        return None
    zero = finite & (b64 == 0)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        rel = np.where(finite & ~zero, diff / np.abs(b64), np.inf)
    rated = bad & ~zero
    scored = np.where(bad, diff, -1.0)
    worst = np.unravel_index(int(np.argmax(scored)), a.shape) if a.ndim else ()
    one_side = int((bad & (np.isfinite(a64) != np.isfinite(b64))).sum())
    both = int((bad & ~np.isfinite(a64) & ~np.isfinite(b64)).sum())
    reason = "; ".join(
        text
        for count, text in (
            (one_side, f"{one_side} non-finite on one side only"),
            (both, f"{both} non-finite on both sides, differently (NaN, +inf, -inf)"),
        )
        if count
    )
    return Mismatch(
        path=path,
        index=tuple(int(i) for i in worst),
        first=float(a64[worst]),
        second=float(b64[worst]),
        count=int(bad.sum()),
        size=int(a.size),
        max_abs=float(np.max(np.where(bad, diff, 0.0))),
        max_rel=float(np.max(np.where(rated, rel, 0.0))) if rated.any() else np.nan,
        tolerance=tol,
        reason=reason,
        zeros=int((bad & zero).sum()),
        accepted=accepted,
        spread_covered=covered,
    )


def compare_trees(
    first: Mapping[str, Any],
    second: Mapping[str, Any],
    tolerance: Tolerance | None = None,
    reference: Mapping[str, Any] | None = None,
    spread: Mapping[str, Any] | None = None,
) -> list[Mismatch]:
    """Compare two flat trees with the same paths; one :class:`Mismatch` per failing leaf.

    The trees must have the same paths (check structure first); a path on one side only
    is reported as a mismatch, never skipped. ``reference`` and ``spread`` are trees of
    :func:`compare_arrays`'s arguments of those names, by path.
    """
    mismatches = []
    for path in sorted(set(first) | set(second)):
        if path not in first or path not in second:
            mismatches.append(
                Mismatch(
                    path,
                    (),
                    np.nan,
                    np.nan,
                    0,
                    0,
                    np.inf,
                    np.inf,
                    tolerance or EXACT,
                    missing_on=int(path not in second),
                )
            )
            continue
        ref = None if reference is None else reference.get(path)
        own = None if spread is None else spread.get(path)
        found = compare_arrays(path, first[path], second[path], tolerance, ref, own)
        if found is not None:
            mismatches.append(found)
    return mismatches


def report(title: str, mismatches: Sequence[Mismatch], names: tuple[str, str]) -> str:
    """A failure message: the title line, then every mismatching leaf, worst first."""
    ordered = sorted(mismatches, key=lambda m: -m.max_abs)
    body = "\n".join("  " + m.describe(names) for m in ordered)
    return f"{title}: {len(mismatches)} leaf(s) disagree\n{body}"
