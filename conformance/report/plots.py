"""Divergence plots of a failing test: error along a figure's axis, one line per series.

A figure is what a check measured along one axis: a forward's decoder blocks, a train
step's leaf groups, decode's stages. Each plot has three panels (max |a-b| with the
absolute tolerance, max relative error with the relative tolerance, and the share of
the tolerance used, whose bound is 1) and marks the first point that disagrees.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from conformance.report.model import Json, to_float

PANELS = (
    ("max_abs", "max |a - b|", "atol"),
    ("max_rel", "max relative error", "rtol"),
    ("used", "share of tolerance used", None),
)
_FLOOR = 1e-18
"""Exact agreement is drawn here on the log scale (0 has no logarithm)."""


def figures(measurements: Sequence[Json]) -> dict[str, list[Json]]:
    """A test's measurements by figure, in the order first seen (unnamed ones left out)."""
    found: dict[str, list[Json]] = {}
    for m in measurements:
        if m["figure"]:
            found.setdefault(m["figure"], []).append(m)
    return found


def first_divergent(measurements: Sequence[Json]) -> str | None:
    """The x of the first measurement that disagrees, in order; ``None`` if all agree."""
    return next((m["x"] for m in measurements if not m["passed"]), None)


def _value(m: Json, key: str) -> float:
    value = to_float(m[key])
    if value != value:  # NaN: nothing to draw
        return float("nan")
    return min(max(value, _FLOOR), 1e30)


def plot_png(title: str, measurements: Sequence[Json]) -> bytes:
    """One figure's plot as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    xs = list(dict.fromkeys(m["x"] for m in measurements))
    series: dict[str, dict[str, Json]] = {}
    for m in measurements:
        series.setdefault(m["series"], {})[m["x"]] = m
    width = max(9.0, 0.35 * len(xs) + 4)
    fig, axes = plt.subplots(1, 3, figsize=(width, 4.2), squeeze=False)
    divergent = first_divergent(measurements)
    tolerance = measurements[0]["tolerance"]
    for ax, (key, label, bound) in zip(axes[0], PANELS, strict=True):
        for name, points in series.items():
            positions = [i for i, x in enumerate(xs) if x in points]
            values = [_value(points[xs[i]], key) for i in positions]
            ax.plot(positions, values, marker="o", label=name)
        limit = 1.0 if bound is None else tolerance[bound]
        if limit > 0:
            what = "bound" if bound is None else f"{bound}={limit:g}"
            ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=what)
        if divergent is not None:
            ax.axvline(xs.index(divergent), color="red", linewidth=1, label="first divergent")
        ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.set_xticks(range(len(xs)), xs, rotation=60 if len(xs) > 4 else 0, ha="right", fontsize=7)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def plots_of(test: Json) -> list[tuple[str, bytes]]:
    """``(figure, png)`` for each figure a failing test measured."""
    return [(name, plot_png(name, ms)) for name, ms in figures(test["measurements"]).items()]


def slug(text: str) -> str:
    """A file-name-safe form of ``text``."""
    keep = [c if c.isalnum() or c in "-_." else "-" for c in text]
    return "".join(keep).strip("-")[:120]
