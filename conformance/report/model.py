"""A run's report as plain JSON values: each process writes a part, parts merge into one.

A process's part holds its header (versions, platform, devices, tier, meshes, command)
and one record per test. Parts live in ``DIR/parts/``, named after the command that
wrote them, so running the same command again replaces its part and running another
command beside it (``make test``'s two processes, CI's MaxText processes) adds one.
:func:`merge` reads every part into the report ``report.json`` holds; start from an
empty directory for a report of one run only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.core.environment import library_versions
from conformance.core.numerics import Mismatch, Tolerance
from conformance.core.records import Costs, Layouts, Measurement

SCHEMA_ID = "conformance-report/1"
"""The ``schema`` field of every report; ``schema.json`` beside this module describes it."""
SCHEMA_PATH = Path(__file__).with_name("schema.json")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
Json = dict[str, Any]


def number(value: float) -> float | str:
    """``value`` as JSON holds it: a number, or ``"Infinity"``, ``"-Infinity"``, ``"NaN"``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def to_float(value: float | str) -> float:
    """The inverse of :func:`number`."""
    return float(value) if not isinstance(value, str) else float(value.lower())


def _tolerance(tol: Tolerance) -> Json:
    return {"atol": tol.atol, "rtol": tol.rtol}


def mismatch_json(m: Mismatch) -> Json:
    """One failing leaf: path, worst index, both values there, errors and tolerance."""
    return {
        "path": m.path,
        "index": list(m.index),
        "first": number(m.first),
        "second": number(m.second),
        "count": m.count,
        "size": m.size,
        "max_abs": number(m.max_abs),
        "max_rel": number(m.max_rel),
        "tolerance": _tolerance(m.tolerance),
        "reason": m.reason,
        "missing_on": m.missing_on,
        "shapes": None if m.shapes is None else [list(s) for s in m.shapes],
    }


def measurement_json(m: Measurement) -> Json:
    """One comparison's numbers (:class:`~conformance.core.records.Measurement`) as JSON."""
    return {
        "title": m.title,
        "names": list(m.names),
        "passed": m.passed,
        "max_abs": number(m.max_abs),
        "max_rel": number(m.max_rel),
        "used": number(m.used),
        "tolerance": _tolerance(m.tolerance),
        "figure": m.figure,
        "series": m.series,
        "x": m.x,
        "mismatches": [mismatch_json(x) for x in m.mismatches],
    }


def costs_json(c: Costs) -> Json:
    """One compiled program's cost on each side (:class:`~conformance.core.records.Costs`)."""
    return {"program": c.program, "sides": {name: dict(t) for name, t in c.sides.items()}}


def layouts_json(layouts: Layouts) -> Json:
    """One program's activation table (:class:`~conformance.core.records.Layouts`)."""
    return {"program": layouts.program, "rows": [list(row) for row in layouts.rows]}


AREA = "conformance_area"
"""The user property a suite test carries its check's area in (``training``, ...)."""
SPENT = ("compiles", "compile_s", "trace_s")
"""The user properties a test carries what its programs cost in: how many XLA made
executable, and the seconds compiling and tracing (with lowering) took."""


@dataclasses.dataclass
class RecordedTest:
    """What a report says about one test, built up from its setup, call and teardown."""

    nodeid: str
    family: str | None = None
    check: str | None = None
    case: str | None = None
    outcome: str = "passed"
    duration_s: float = 0.0
    message: str = ""
    measurements: list[Json] = dataclasses.field(default_factory=list)
    costs: list[Json] = dataclasses.field(default_factory=list)
    layouts: list[Json] = dataclasses.field(default_factory=list)
    """The activation tables its checks left (``activation_sharding``)."""
    area: str | None = None
    """Its check's area (:data:`AREA`); ``None`` for a test that is not a suite check's."""
    compiles: int = 0
    compile_s: float = 0.0
    trace_s: float = 0.0
    """What its programs cost (:data:`SPENT`): how many compiled, seconds compiling, tracing."""

    def to_json(self) -> Json:
        """The record as ``report.json`` holds it."""
        seconds = ("duration_s", "compile_s", "trace_s")
        return {**dataclasses.asdict(self), **{k: round(getattr(self, k), 3) for k in seconds}}


def plain_nodeid(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` that pytest-xdist's ``--dist loadgroup`` appends."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") and "::" in nodeid[:at] else nodeid


def case_of(nodeid: str, family: str | None) -> str | None:
    """The parameter id of a suite test, without its family: ``data2-fsdp2-tensor2-scan``."""
    if "[" not in nodeid:
        return None
    case = nodeid[nodeid.index("[") + 1 : nodeid.rindex("]")]
    return case.removeprefix(f"{family}-") if family else case


def header(
    tier: str,
    meshes: Sequence[str],
    xla_opt: str,
    families: Sequence[str],
    bridged: Mapping[str, Sequence[str]] | None = None,
) -> Json:
    """A process's run header: library versions, platform and devices, tier and meshes.

    ``bridged`` names each family's sides that are the other backend's model behind a
    bridge (``{"maxtext-gpt3": ["Linen"]}``); the matrix labels those families.
    """
    import jax

    versions = library_versions()
    devices = jax.devices()
    return {
        "versions": versions,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "tier": tier,
        "meshes": list(meshes),
        "xla_opt": xla_opt,
        "families": list(families),
        "bridged": {family: list(sides) for family, sides in (bridged or {}).items()},
    }


def part_name(command: Sequence[str]) -> str:
    """The file a process's part is kept in: one per distinct command line."""
    digest = hashlib.sha256("\0".join(command).encode()).hexdigest()[:16]
    return f"{digest}.json"


def write_part(
    root: Path, run: Json, tests: Iterable[RecordedTest], upgrades: Sequence[Json] = ()
) -> Path:
    """Write one process's part under ``root/parts`` (atomically) and return its path.

    ``upgrades`` are release-upgrade sections (``python -m conformance.upgrade``).
    """
    parts = root / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    path = parts / part_name(run["command"])
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    part = {"run": run, "tests": [t.to_json() for t in tests]}
    if upgrades:
        part["upgrades"] = list(upgrades)
    scratch.write_text(json.dumps(part))
    scratch.replace(path)
    return path


class ReportError(Exception):
    """A report directory holds a part that cannot be read."""


def merge(root: Path) -> Json:
    """The report of every part under ``root/parts``: runs in start order, then tests."""
    parts = []
    for path in sorted((root / "parts").glob("*.json")):
        try:
            part = json.loads(path.read_text())
            if not isinstance(part, dict) or not {"run", "tests"} <= part.keys():
                raise ValueError("not a report part (no 'run' and 'tests')")
        except (OSError, ValueError) as err:
            raise ReportError(f"cannot read report part {path}: {err}") from None
        parts.append(part)
    parts.sort(key=lambda p: p["run"].get("started", ""))
    tests = [t for p in parts for t in p["tests"]]
    totals = Counter(t["outcome"] for t in tests)
    report = {
        "schema": SCHEMA_ID,
        "runs": [p["run"] for p in parts],
        "summary": {o: totals.get(o, 0) for o in OUTCOMES},
        "tests": tests,
    }
    if upgrades := [u for p in parts for u in p.get("upgrades", [])]:
        report["upgrades"] = upgrades
    if spent := time_by_area(tests):
        report["time"] = spent
    return report


def time_by_area(tests: Sequence[Mapping[str, Any]]) -> list[Json]:
    """Where the tests' time went, per check area, the costliest first.

    ``wall_s`` sums the tests' durations (setup, call and teardown); of it, ``trace_s``
    traced and lowered, ``compile_s`` compiled, and ``run_s`` is the rest (running the
    programs, and the harness's own work). A test without an area is left out.
    """
    areas: dict[str, Counter[str]] = {}
    for test in tests:
        if (area := test.get("area")) is None:
            continue
        totals = areas.setdefault(area, Counter())
        totals["tests"] += 1
        totals["wall_s"] += test["duration_s"]
        for name in SPENT:
            totals[name] += test.get(name, 0)
    rows = [
        {
            "area": area,
            "tests": t["tests"],
            "wall_s": round(t["wall_s"], 3),
            "trace_s": round(t["trace_s"], 3),
            "compile_s": round(t["compile_s"], 3),
            "run_s": round(max(t["wall_s"] - t["trace_s"] - t["compile_s"], 0.0), 3),
            "compiles": t["compiles"],
        }
        for area, t in areas.items()
    ]
    return sorted(rows, key=lambda r: (-r["wall_s"], r["area"]))


def suite_tests(report: Mapping[str, Any]) -> list[Json]:
    """The report's tests that ran a check on a family (the matrix's tests)."""
    return [t for t in report["tests"] if t["family"] and t["check"]]


def cells(report: Mapping[str, Any]) -> dict[tuple[str, str], Counter[str]]:
    """Outcome counts per ``(family, check)``."""
    found: dict[tuple[str, str], Counter[str]] = {}
    for t in suite_tests(report):
        found.setdefault((t["family"], t["check"]), Counter())[t["outcome"]] += 1
    return found


_CELL_EXTRAS = {"failed": "f", "error": "e", "skipped": "s", "xfailed": "x", "xpassed": "X"}

CELL_LEGEND = "agreed/run; " + " ".join(f"{c}={k}" for k, c in _CELL_EXTRAS.items())
"""What a matrix cell's numbers and letters mean, for every rendering of the matrix."""


def cell_text(counts: Mapping[str, int]) -> str:
    """A matrix cell: ``agreed/run``, then the other outcomes' counts (see CELL_LEGEND)."""
    run = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
    text = f"{counts.get('passed', 0)}/{run}" if run else "-"
    extras = [f"{counts[k]}{c}" for k, c in _CELL_EXTRAS.items() if counts.get(k)]
    return text + (f" ({' '.join(extras)})" if extras else "")


def matrix_rows(
    results: Mapping[tuple[str, str], Mapping[str, int]],
    bridged: Mapping[str, Sequence[str]] | None = None,
) -> list[list[str]]:
    """The family x check table: a header row, then one row of :func:`cell_text` per family.

    A family with a ``bridged`` side is labelled so (``maxtext-gpt3 (Linen bridged)``):
    its parity tests a bridge around one model, not two implementations.
    """
    bridged = bridged or {}
    families = sorted({f for f, _ in results})
    checks = sorted({c for _, c in results})
    rows = [["family", *checks]]
    for f in families:
        label = f"{f} ({', '.join(bridged[f])} bridged)" if bridged.get(f) else f
        rows.append(
            [label, *(cell_text(results[f, c]) if (f, c) in results else "" for c in checks)]
        )
    return rows


def bridged_sides(report: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each family's bridged sides, as the report's runs declare them."""
    found: dict[str, list[str]] = {}
    for run in report["runs"]:
        for family, sides in run.get("bridged", {}).items():
            found[family] = sorted({*found.get(family, []), *sides})
    return found


def headroom(report: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """Per ``(family, check)``, the largest share of its tolerance an agreeing comparison used.

    Only checks that measure (forward, train steps, decode) appear; 0 means every
    comparison was exact.
    """
    worst: dict[tuple[str, str], float] = {}
    for t in suite_tests(report):
        for m in t["measurements"]:
            if m["passed"]:
                key = (t["family"], t["check"])
                worst[key] = max(worst.get(key, 0.0), to_float(m["used"]))
    return worst


def upgrade_lines(report: Mapping[str, Any], limit: int = 12) -> list[str]:
    """The release-upgrade section as Markdown lines, empty when the report has none.

    Per family: golden changes from each earlier release (at most ``limit`` lines per
    golden), the recorded one-step states (checkpoints of the release that recorded
    them) against the live train state, and the run's ``recorded_*`` verdicts (numbers
    of the installed release against the references).
    """
    lines = []
    for upgrade in report.get("upgrades", []):
        family = upgrade["family"]
        lines += ["", f"### {family}: release {upgrade['release']}", ""]
        changed = upgrade["goldens"]
        lines.append(
            f"Goldens: {len(changed)} changed, added or removed; "
            f"{upgrade['unchanged_goldens']} unchanged."
        )
        for golden in changed:
            head = f"- `{golden['golden']}` {golden['change']} since {golden['from']}"
            shown = golden["lines"][:limit]
            more = len(golden["lines"]) - len(shown)
            lines += [head, *(f"  - `{line}`" for line in shown)]
            lines += [f"  - ... and {more} more"] if more else []
        for point in upgrade["checkpoints"]:
            lines.append(
                f"- Checkpoint of {point['recorded_with']}: "
                f"{point['unchanged']} of {point['leaves']} leaves unchanged"
                + (":" if point["moved"] else "")
            )
            lines += [f"  - `{line}`" for line in point["moved"]]
        verdicts: dict[str, Counter[str]] = {}
        for t in suite_tests(report):
            if t["family"] == family and t["check"].startswith("recorded_"):
                verdicts.setdefault(t["check"], Counter())[t["outcome"]] += 1
        if verdicts:
            shown = ", ".join(f"{c} {cell_text(n)}" for c, n in sorted(verdicts.items()))
            lines.append(f"- Numbers against the recorded references: {shown}")
        else:
            lines.append("- Numbers: no recorded_* check of this family ran in this report")
    return lines


def failures(report: Mapping[str, Any]) -> list[Json]:
    """The tests that failed or errored, in report order."""
    return [t for t in report["tests"] if t["outcome"] in ("failed", "error", "xpassed")]
