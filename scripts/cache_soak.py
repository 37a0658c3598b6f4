"""Soak CI's exact sequence with a shared persistent compilation cache, against a run without.

Runs ``.ci/run`` once with the cache off (``CI_CACHE=off``, the reference), then ``--runs``
times with ``CI_CACHE=shared`` (every process of one CI run shares one fresh cache
directory, so a program the parity run compiled is read back by ``tests/``, the 2-host
run and the installed wheel's run). After each run it reads every ``junit.xml`` under
``reports/`` and compares each test's verdict (passed, failed, error, skipped, xfailed)
with the reference's, and searches the log for a crash (``Fatal Python error``, a
process killed by a signal).

Prints one line per run: exit status, wall and CPU seconds, tests, verdicts that differ
from the reference and crashes; writes the same as ``soak.json``, and each run's log and
reports, under ``--out``. The cache is safe for CI only after ``--runs 20`` shows no crash
and no differing verdict (docs/development.md, "The persistent compilation cache is opt-in").

``--reference DIR`` takes the cache-off run from an earlier soak's ``run-00-off``
directory instead of running it again, so that the runs a long soak needs can be spread
over several sittings: it must have been run with the tests, pins and ``.ci/run`` checked
out now, and each row of ``soak.json`` names its commit.

This is a soak, not a test: its exit status is 1 when any run crashed or a verdict
differed, else 0. It takes about as long as ``--runs + 1`` CI runs, one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRASH = re.compile(r"Fatal Python error|Segmentation fault|core dumped|exit -?(6|11|134|139)\b")


def verdicts(reports: Path) -> dict[str, str]:
    """Each test's verdict in every ``junit.xml`` under ``reports``, keyed by file and id."""
    found: dict[str, str] = {}
    for junit in sorted(reports.rglob("junit.xml")):
        where = junit.parent.relative_to(reports).as_posix()
        for case in ET.parse(junit).iter("testcase"):
            key = f"{where}::{case.get('classname')}::{case.get('name')}"
            found[key] = outcome(case)
    return found


def outcome(case: ET.Element) -> str:
    """The verdict one junit ``testcase`` records."""
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "error"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def ci_run(cache: str, out: Path) -> dict[str, object]:
    """Run ``.ci/run`` once with ``CI_CACHE=cache``; keep its log and reports in ``out``."""
    out.mkdir(parents=True)
    env = {**os.environ, "CI_CACHE": cache}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with open(out / "ci.log", "w") as log:
        rc = subprocess.call([str(ROOT / ".ci" / "run")], cwd=ROOT, env=env, stdout=log, stderr=log)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    shutil.copytree(ROOT / "reports", out / "reports")
    text = (out / "ci.log").read_text(errors="replace")
    return {
        "commit": head(),
        "cache": cache,
        "exit": rc,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "crashes": sorted({m.group(0) for m in CRASH.finditer(text)}),
        "summary": next((line for line in text.splitlines() if line.startswith("CI_SCOPE=")), ""),
        "verdicts": verdicts(out / "reports"),
    }


def head() -> str:
    """The commit checked out in this repository."""
    return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()


def differences(reference: dict[str, str], run: dict[str, str]) -> list[str]:
    """Tests whose verdict differs from the reference's, or that only one run has."""
    return [
        f"{key}: {reference.get(key, 'absent')} -> {run.get(key, 'absent')}"
        for key in sorted(reference.keys() | run.keys())
        if reference.get(key) != run.get(key)
    ]


def main() -> int:
    """Run the reference and the cache-on runs; 1 if any crashed or differs, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="cache-on CI runs (default 20)")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the logs")
    parser.add_argument(
        "--reference",
        type=Path,
        help="an earlier soak's run-00-off directory, run with this checkout's tests, pins and "
        ".ci/run, instead of a new cache-off run",
    )
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"--out {args.out} exists; name a new directory")
    reference: dict[str, str] = {}
    if args.reference is not None:
        reference = verdicts(args.reference / "reports")
        if not reference:
            parser.error(f"--reference {args.reference} has no reports/**/junit.xml")
    rows: list[dict[str, object]] = []
    bad = False
    for index in range(1 if reference else 0, args.runs + 1):
        cache = "off" if index == 0 else "shared"
        row = ci_run(cache, args.out / f"run-{index:02d}-{cache}")
        found = row.pop("verdicts")
        assert isinstance(found, dict)
        if index == 0:
            reference = found
        row["tests"] = len(found)
        row["differ"] = differences(reference, found)
        bad |= bool(row["crashes"] or row["differ"])
        rows.append(row)
        print(
            f"run {index:2d} cache {cache:6s} exit {row['exit']} wall {row['wall_s']:7.1f} s "
            f"CPU {row['cpu_s']:7.1f} s tests {row['tests']} differing {len(row['differ'])} "
            f"crashes {row['crashes'] or 'none'}",
            flush=True,
        )
        for line in row["differ"][:20]:
            print(f"    {line}")
        (args.out / "soak.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
