"""The report's tables of compiled programs: cost, activation layouts, memory on TPU.

Each is built from the suite tests of ``report.json``
(:func:`~conformance.report.model.suite_tests`) as rows of strings, the first the
header, for :mod:`conformance.report.render`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.report.model import suite_tests

COST_MEASURES = ("flops", "bytes_accessed", "argument_bytes", "temp_bytes")
"""The measures a report's cost table shows per program, as the second side's / the first's."""


def cost_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """The cost table: per family, case and program, the second side's measures over the first's.

    The sides are a cost's two, in order: Linen then NNX, or a mode pair's reference
    mode (graph mode, auto axes) then the mode held to it (the case names the pair).
    Each cell is ``second's value (ratio)``; the collectives column says whether both
    sides run the same collectives (kind, count and bytes), else what the second runs,
    headed by its key (``nnx``, ``nnx-tree``).
    """
    rows = [["family", "case", "program", *COST_MEASURES, "collectives"]]
    for t in suite_tests(report):
        for cost in t.get("costs", []):
            if len(cost["sides"]) != 2:
                continue
            (_, first), (key, second) = cost["sides"].items()
            cells = []
            for measure in COST_MEASURES:
                a, b = first[measure], second[measure]
                cells.append(f"{b:,.0f} ({b / a:.3f}x)" if a else f"{b:,.0f}")
            same = first["collectives"] == second["collectives"]
            kinds = ", ".join(f"{k} x{v['count']}" for k, v in second["collectives"].items())
            collectives = ("same: " if same else f"{key}: ") + (kinds or "none")
            rows.append([t["family"], t["case"] or "", cost["program"], *cells, collectives])
    return rows


def layout_rows(report: Mapping[str, Any], *, calls: bool) -> list[list[str]]:
    """The activation tables: per family, case and program, the second side's output layouts.

    The second side is NNX, or a mode pair's second mode (the case names the pair). With
    ``calls``, a row per module call, the first side's layouts beside the second's where
    they differ; else a row per program: its calls and how many are laid out differently.
    """
    head = ["family", "case", "program"]
    rows = [
        [*head, "call", "output", "first side's, where it differs"]
        if calls
        else [*head, "calls", "laid out differently"]
    ]
    for t in suite_tests(report):
        for table in t.get("layouts", []):
            at = [t["family"], t["case"] or "", table["program"]]
            if calls:
                rows += [[*at, *row] for row in table["rows"]]
            else:
                apart = sum(1 for row in table["rows"] if row[2])
                rows.append([*at, str(len(table["rows"])), str(apart)])
    return rows


def memory_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """The TPU memory table: per family, case and program, each side's GiB per device.

    Rows come from programs compiled for a TPU slice (``tpu_compile``), whose costs carry
    each side's footprint per device and the chip's HBM; the last columns give NNX's
    ratio to Linen and the larger side's share of the chip.
    """
    rows = [["family", "case", "program", "Linen GiB", "NNX GiB", "NNX / Linen", "% of HBM"]]
    for t in suite_tests(report):
        for cost in t.get("costs", []):
            linen, nnx_ = cost["sides"].get("linen"), cost["sides"].get("nnx")
            if linen is None or nnx_ is None or "footprint_bytes" not in linen:
                continue
            a, b, hbm = linen["footprint_bytes"], nnx_["footprint_bytes"], linen["hbm_bytes"]
            rows.append(
                [
                    t["family"],
                    t["case"] or "",
                    cost["program"],
                    f"{a / 2**30:.2f}",
                    f"{b / 2**30:.2f}",
                    f"{b / a:.3f}x" if a else "-",
                    f"{max(a, b) / hbm:.0%}",
                ]
            )
    return rows
