"""The merged report as files: JSON, Markdown, one self-contained HTML page, JUnit XML.

:func:`write` renders all four (and the failures' plots) from the parts under a
directory (:func:`add_part` adds a process's part first); each file is written whole and
then moved into place, so a reader never sees half a report.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import html
import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from conformance.report import plots
from conformance.report.model import (
    CELL_LEGEND,
    Json,
    RecordedTest,
    bridged_sides,
    cells,
    failures,
    headroom,
    matrix_rows,
    merge,
    upgrade_lines,
    write_part,
)
from conformance.report.tables import cost_rows, layout_rows, memory_rows

MARKDOWN_LIMIT = 1 << 20
"""GitHub's step summary holds at most 1 MiB; the Markdown report stays under it."""
_MESSAGE_LIMIT = 6000
"""Characters of one failure's report shown in Markdown (the JSON keeps it whole)."""

FILES = ("report.json", "report.md", "report.html", "junit.xml")


def _replace(path: Path, text: str | bytes) -> None:
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(text, bytes):
        scratch.write_bytes(text)
    else:
        scratch.write_text(text)
    scratch.replace(path)


def _title(test: Json) -> str:
    if test["family"]:
        return f"{test['family']} {test['check']} [{test['case']}]"
    return test["nodeid"]


def _runs_line(report: Json) -> str:
    runs = report["runs"]
    if not runs:
        return "no runs"
    first = runs[0]
    versions = ", ".join(f"{k} {v}" for k, v in first["versions"].items())
    tiers = ", ".join(sorted({r["tier"] for r in runs}))
    meshes = ", ".join(dict.fromkeys(m for r in runs for m in r["meshes"]))
    return (
        f"{len(runs)} process(es); tier {tiers}; meshes {meshes}; "
        f"{first['device_count']} {first['platform']} device(s); {versions}"
    )


def _summary_line(report: Json) -> str:
    return ", ".join(f"{n} {k}" for k, n in report["summary"].items() if n)


def _headroom_rows(report: Json) -> list[list[str]]:
    room = headroom(report)
    rows = [["family", "check", "largest share of tolerance used", "headroom"]]
    for (family, check), used in sorted(room.items()):
        rows.append([family, check, f"{used:.3g}", "exact" if used == 0 else f"{1 / used:.3g}x"])
    return rows


def _time_rows(report: Json) -> list[list[str]]:
    """The report's time per check area as a table; empty when it has none."""
    if not report.get("time"):
        return []
    head = ["area", "tests", "wall", "trace", "compile", "run and the rest", "programs compiled"]
    return [head] + [
        [
            t["area"],
            str(t["tests"]),
            *(f"{t[k]:.1f}" for k in ("wall_s", "trace_s", "compile_s", "run_s")),
            str(t["compiles"]),
        ]
        for t in report["time"]
    ]


_COSTS = "Compiled cost (NNX, or the second mode of a mode pair, and its ratio to the first side)"
_LAYOUTS = (
    "Activation shardings (NNX's compiled layouts, or the second mode's of a mode pair; "
    "the first side's where they differ)"
)


def markdown(report: Json, limit: int = MARKDOWN_LIMIT) -> str:
    """The matrix, headroom, cost table and a section per failure, under ``limit`` bytes."""

    def table(rows: list[list[str]]) -> list[str]:
        head, *body = rows
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return lines + ["| " + " | ".join(r) + " |" for r in body]

    lines = [
        "# Linen/NNX conformance report",
        "",
        f"{_summary_line(report)}. {_runs_line(report)}.",
        "",
        f"## Agreement ({CELL_LEGEND})",
        "",
    ]
    results = cells(report)
    lines += (
        table(matrix_rows(results, bridged_sides(report))) if results else ["No suite test ran."]
    )
    if headroom(report):
        lines += ["", "## Headroom of agreeing comparisons", "", *table(_headroom_rows(report))]
    if len(costs := cost_rows(report)) > 1:
        lines += ["", f"## {_COSTS}", "", *table(costs)]
    if len(memory := memory_rows(report)) > 1:
        lines += ["", "## Memory per device, compiled for TPU", "", *table(memory)]
    if len(layouts := layout_rows(report, calls=False)) > 1:
        lines += ["", "## Activation shardings (each call's layouts: the HTML page)", ""]
        lines += table(layouts)
    if upgrade := upgrade_lines(report):
        lines += ["", "## Release upgrade", *upgrade]
    if spent := _time_rows(report):
        lines += ["", "## Where the time goes (seconds, summed over processes)", "", *table(spent)]
    failed = failures(report)
    lines += ["", f"## Failures ({len(failed)})", ""]
    text = "\n".join(lines) + "\n"
    for i, test in enumerate(failed):
        message = test["message"]
        if len(message) > _MESSAGE_LIMIT:
            message = message[:_MESSAGE_LIMIT] + "\n... (cut; report.json holds it whole)"
        section = f"### {_title(test)}\n\n`{test['nodeid']}`\n\n```\n{message}\n```\n\n"
        note = f"... and {len(failed) - i} more failure(s): see report.json\n"
        if len((text + section + note).encode()) > limit:
            return text + note
        text += section
    return text


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #bbb; padding: 3px 8px; text-align: left; }
td.pass { background: #dff3df; } td.fail { background: #f6d3d3; }
td.other { background: #f1f1f1; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
"""


def _cell_class(counts: Mapping[str, int]) -> str:
    if counts.get("failed") or counts.get("error"):
        return "fail"
    return "pass" if counts.get("passed") else "other"


def _html_table(rows: list[list[str]], classes: list[list[str]] | None = None, **attrs: str) -> str:
    extra = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
    head, *body = rows
    out = [f"<table{extra}><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for r, row in enumerate(body):
        cls = classes[r] if classes else [""] * len(row)
        tds = "".join(
            f'<td class="{c}">{html.escape(v)}</td>' if c else f"<td>{html.escape(v)}</td>"
            for v, c in zip(row, cls, strict=True)
        )
        out.append(f"<tr>{tds}</tr>")
    return "\n".join(out) + "</table>"


def page(report: Json, images: Mapping[str, list[tuple[str, bytes]]]) -> str:
    """The self-contained HTML page: matrix, headroom, cost table, each failure with plots."""
    results = cells(report)
    rows = matrix_rows(results, bridged_sides(report))
    families = sorted({f for f, _ in results})  # the rows' order, before their labels
    classes = [["", *(_cell_class(results.get((f, c), {})) for c in rows[0][1:])] for f in families]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>Linen/NNX conformance report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Linen/NNX conformance report</h1>",
        f"<p>{html.escape(_summary_line(report))}. {html.escape(_runs_line(report))}.</p>",
        f"<h2>Agreement</h2><p>{CELL_LEGEND}</p>",
        _html_table(rows, classes, id="matrix") if results else "<p>No suite test ran.</p>",
    ]
    if headroom(report):
        parts += ["<h2>Headroom of agreeing comparisons</h2>", _html_table(_headroom_rows(report))]
    if len(costs := cost_rows(report)) > 1:
        parts += [f"<h2>{_COSTS}</h2>", _html_table(costs)]
    if len(memory := memory_rows(report)) > 1:
        parts += ["<h2>Memory per device, compiled for TPU</h2>", _html_table(memory)]
    if len(layouts := layout_rows(report, calls=True)) > 1:
        parts += [f"<h2>{_LAYOUTS}</h2>", _html_table(layouts)]
    if upgrade := upgrade_lines(report):
        text = "\n".join(upgrade).strip()
        parts += ["<h2>Release upgrade</h2>", f"<pre>{html.escape(text)}</pre>"]
    if spent := _time_rows(report):
        parts += ["<h2>Where the time goes (seconds, summed over processes)</h2>"]
        parts.append(_html_table(spent))
    failed = failures(report)
    parts.append(f"<h2>Failures ({len(failed)})</h2>")
    for test in failed:
        parts.append(
            f"<h3>{html.escape(_title(test))}</h3><code>{html.escape(test['nodeid'])}</code>"
        )
        parts.append(f"<pre>{html.escape(test['message'])}</pre>")
        for figure, png in images.get(test["nodeid"], []):
            data = base64.b64encode(png).decode()
            parts.append(f'<img alt="{html.escape(figure)}" src="data:image/png;base64,{data}">')
    parts.append("</body></html>")
    return "\n".join(parts)


def junit(report: Json) -> str:
    """JUnit XML of every test (one ``testsuite``), as CI systems read it."""
    tests = report["tests"]
    summary = report["summary"]
    suite = ET.Element(
        "testsuite",
        name="conformance",
        tests=str(len(tests)),
        failures=str(summary["failed"] + summary["xpassed"]),
        errors=str(summary["error"]),
        skipped=str(summary["skipped"] + summary["xfailed"]),
        time=f"{sum(t['duration_s'] for t in tests):.3f}",
    )
    for test in tests:
        path, _, name = test["nodeid"].rpartition("::")
        case = ET.SubElement(
            suite,
            "testcase",
            classname=path.replace("/", ".").removesuffix(".py"),
            name=name,
            time=f"{test['duration_s']:.3f}",
        )
        if test["family"]:
            props = ET.SubElement(case, "properties")
            for key in ("family", "check", "case"):
                ET.SubElement(props, "property", name=key, value=str(test[key]))
        first_line = test["message"].splitlines()[0] if test["message"] else ""
        match test["outcome"]:
            case "failed" | "xpassed":
                ET.SubElement(case, "failure", message=first_line).text = test["message"]
            case "error":
                ET.SubElement(case, "error", message=first_line).text = test["message"]
            case "skipped" | "xfailed":
                ET.SubElement(case, "skipped", message=first_line)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold ``root``'s lock: processes finishing together render one after the other."""
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add_part(
    root: Path, run: Json, tests: Iterable[RecordedTest], upgrades: Sequence[Json] = ()
) -> Json:
    """Write a process's part under ``root``, then every report file; return the report.

    Under ``root``'s lock, so processes finishing together take turns.
    """
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        write_part(root, run, tests, upgrades)
        return write(root)


def write(root: Path) -> Json:
    """Merge the parts under ``root`` and (re)write every report file there; return the report.

    The failures' plots are also written as PNG files under ``root/plots``.
    """
    report = merge(root)
    images: dict[str, list[tuple[str, bytes]]] = {}
    plot_dir = root / "plots"
    for test in failures(report):
        made = plots.plots_of(test)
        if made:
            images[test["nodeid"]] = made
            plot_dir.mkdir(exist_ok=True)
            for figure, png in made:
                _replace(plot_dir / f"{plots.slug(_title(test))}--{plots.slug(figure)}.png", png)
    _replace(root / "report.json", json.dumps(report, indent=1))
    _replace(root / "report.md", markdown(report))
    _replace(root / "report.html", page(report, images))
    _replace(root / "junit.xml", junit(report))
    return report
