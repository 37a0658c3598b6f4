"""Report the conformance suite's wall time as CI runs it, and with a compilation cache.

Runs the suite three times, each in one fresh process: ``ci`` with the persistent
compilation cache off, as CI and a newcomer run it; then ``cold`` and ``warm`` sharing a
new persistent cache (empty, then filled by the cold run). Prints for each run its wall
time, how many programs it compiled (and how many distinct), how long XLA took, and the
peak count of memory mappings; then, per area (suite module: forward, train step,
checkpoint, ...) and per check, the tests, their seconds and their compiles in each
run. ``--runs ci`` runs only the first.

``--tier`` (default ``default``) and ``--family`` choose what runs (default: the
built-in families); any other argument goes to pytest, e.g.
``python scripts/benchmark.py --tier smoke -k forward``.

``--budget`` instead runs each tier of :data:`BUDGET` as ``make parity TIER=<tier>``
does (the built-in families, one pytest-xdist worker per core, at most 4, cache off) and
prints its wall time against the tier's budget. One machine's speed moves by up to 2.2x
from hour to hour, so ``--budget --calibrate`` first runs :data:`REFERENCE` (a commit whose
time in the budget's hour is recorded) in a worktree and venv of its own, and scales the
budgets by how much slower it runs now; ``--scale`` sets that factor by hand instead.
``--calibrate`` alone prints the factor and stops: taken before and after ``.ci/run``, it
scales CI's 30 minutes the same way.

This is a benchmark, not a test: it never fails on a time (``--budget`` fails only when
a run itself fails).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

SUITE = "conformance/suite"
BUILTIN = ("gpt3", "llama", "moe")
SUMMARY = re.compile(
    r"^(\d+ programs compiled.*|compiled programs released .*|\d+ passed.*|=+ .* =+)$"
)
RUNS = ("ci", "cold", "warm")
BUDGET = {"smoke": 180.0, "default": 420.0}
"""Seconds each tier's parity run may take on a fresh clone, cache off, on the faster of
CI's 2-core machine kinds (docs/speed.md); CI per change has 30 minutes in all."""


class Reference(NamedTuple):
    """A commit's tier and its wall seconds (once set up) in the hour the budgets were set in.

    Run again beside a measurement, it gives that hour's speed.
    """

    commit: str
    tier: str
    seconds: float


REFERENCE = Reference("3aef52a3f74b3782f194b88bb75348ddc1e2fa4e", "smoke", 161.0)
"""The first row of docs/speed.md's table: the smoke tier at 3aef52a on machine A; run again,
it installs the pins of its own constraints files."""


def run_suite(
    cache_dir: Path | None, junit: Path, pytest_args: list[str]
) -> tuple[float, int, list[str]]:
    """Run the suite once; return (wall seconds, pytest exit code, its summary lines).

    With ``cache_dir`` the persistent compilation cache is on there, else off.
    """
    env = dict(os.environ)
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is None:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    else:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    command = [
        *(sys.executable, "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider"),
        *(f"--junitxml={junit}", "-o", "junit_family=xunit1", *pytest_args),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if SUMMARY.match(line)]
    if not junit.exists():  # the process died: show how
        output = (done.stdout + done.stderr).splitlines()
        lines += ["the process left no report; its last output:", *output[-25:]]
    return wall, done.returncode, [line for line in lines if not line.startswith("=")]


def totals(junit: Path, key: str) -> dict[str, tuple[int, float, int, float]]:
    """``{name: (tests, seconds, compiles, compile seconds)}`` from a JUnit XML report.

    A check is a test function without ``test_``; an area is a suite module without
    ``test_`` (``decode`` for ``conformance/suite/test_decode.py``).
    """
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
    if not junit.exists():
        return {}
    for case in ET.parse(junit).iter("testcase"):
        if key == "check":
            name = case.get("name", "").split("[")[0].removeprefix("test_")
        else:
            name = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        row = sums[name]
        row[0] += 1
        row[1] += float(case.get("time", 0))
        row[2] += int(props.get("compiles", 0))
        row[3] += float(props.get("compile_s", 0.0))
    return {k: (int(n), t, int(c), cs) for k, (n, t, c, cs) in sorted(sums.items())}


def parity_workers() -> int:
    """The pytest-xdist workers ``make parity`` starts: one per core (``nproc``), at most 4."""
    return min(len(os.sched_getaffinity(0)), 4)


def parity_wall(
    python: Path, cwd: Path, tier: str, families: list[str], pytest_args: list[str]
) -> tuple[float, int]:
    """Run one tier as ``make parity TIER=<tier>`` does, cache off; return (wall s, exit code).

    ``python`` runs it in ``cwd``, on :func:`parity_workers` pytest-xdist workers.
    """
    workers = parity_workers()
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [str(python), "-m", "conformance", "--tier", tier]
    command += [a for f in families for a in ("--family", f)]
    command += [*(["-n", str(workers)] if workers > 1 else []), *pytest_args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=False)
    return time.perf_counter() - start, done.returncode


def calibrate(reference: Reference) -> float:
    """How many times slower this machine runs now than in the hour the budgets were set in.

    That is the reference commit's tier, run now in a worktree and venv of its own, over its
    recorded seconds. Raises ``SystemExit`` with one line when the reference cannot be set
    up or does not pass.
    """
    short = reference.commit[:7]
    if missing := [tool for tool in ("git", "make") if shutil.which(tool) is None]:
        raise SystemExit(f"error: --calibrate needs {' and '.join(missing)} on PATH")

    def git(*args: str) -> int:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, check=False
        ).returncode

    if git("cat-file", "-e", f"{reference.commit}^{{commit}}") != 0:
        raise SystemExit(
            f"error: the reference {short} is not in this clone's history "
            "(`git fetch --unshallow` brings it)"
        )
    with tempfile.TemporaryDirectory(prefix="conformance-reference-") as tmp:
        tree = Path(tmp) / "reference"
        if git("worktree", "add", "--detach", "--quiet", str(tree), reference.commit) != 0:
            raise SystemExit(f"error: cannot check out the reference {short} in {tmp}")
        try:
            setup = subprocess.run(
                ["make", "-C", str(tree), "setup"], capture_output=True, text=True, check=False
            )
            if setup.returncode != 0:
                lines = [line for line in setup.stderr.splitlines() if "***" not in line]
                why = (lines or ["no output"])[-1].strip()
                raise SystemExit(f"error: `make setup` of the reference {short} failed: {why}")
            python = tree / ".venv" / "bin" / "python"
            wall, code = parity_wall(python, tree, reference.tier, list(BUILTIN), [])
        finally:
            git("worktree", "remove", "--force", str(tree))
            git("worktree", "prune")
    if code != 0:
        raise SystemExit(f"error: the reference {short}'s {reference.tier} tier exited {code}")
    scale = wall / reference.seconds
    then = f"{reference.seconds:.0f} s in the budgets' hour"
    print(f"reference {short}, tier {reference.tier}: {wall:.1f} s now, {then}: x{scale:.2f}")
    return scale


def budget(families: list[str], scale: float, pytest_args: list[str]) -> int:
    """Run each tier of :data:`BUDGET` as ``make parity`` does; print it against its budget.

    ``scale`` multiplies the budgets, for a slower machine or hour (2.39 on **B** of
    docs/speed.md, or what :func:`calibrate` measured). Returns 1 when a run did not pass
    (its time then says nothing), else 0.
    """
    workers = parity_workers()
    failed = 0
    print(f"each tier as `make parity TIER=<tier>` runs it: {', '.join(families)}, ", end="")
    print(f"{workers} worker(s) on {os.cpu_count()} CPU cores, compilation cache off")
    print(f"{'tier':<8} {'wall':>8} {'budget':>8}  verdict")
    for tier, seconds in BUDGET.items():
        allowed = seconds * scale
        wall, code = parity_wall(Path(sys.executable), ROOT, tier, families, pytest_args)
        verdict = "within" if wall <= allowed else f"over by {100 * (wall / allowed - 1):.0f} %"
        if code != 0:
            failed, verdict = 1, f"not measured: the run exited {code}"
        print(f"{tier:<8} {wall:7.1f}s {allowed:7.0f}s  {verdict}")
    print(f"CI per change: `.ci/run` prints its own wall time (budget {1800 * scale:.0f} s)")
    return failed


def main() -> int:
    """Run as CI runs it, then cold and warm with a cache, and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="default")
    parser.add_argument("--family", action="append", default=[])
    parser.add_argument(
        "--runs", default=",".join(RUNS), help=f"comma-separated runs of {', '.join(RUNS)}"
    )
    parser.add_argument("--budget", action="store_true", help="each tier against its budget")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the budgets (2.39 on machine B)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help=f"measure this hour's speed ({REFERENCE.commit[:7]} run now); with --budget, "
        "scale the budgets by it",
    )
    args, pytest_args = parser.parse_known_args()
    families = args.family or list(BUILTIN)
    if args.calibrate and args.scale != 1.0:
        parser.error("--calibrate measures the scale: give it or --scale, not both")
    scale = calibrate(REFERENCE) if args.calibrate else args.scale
    if args.budget:
        return budget(families, scale, pytest_args)
    if args.calibrate:  # the hour's factor alone, e.g. taken before and after a `.ci/run`
        print(f"CI per change at this speed: budget {1800 * scale:.0f} s (30 minutes x{scale:.2f})")
        return 0
    pytest_args = [
        "--conformance-tier",
        args.tier,
        *(a for f in families for a in ("--conformance-family", f)),
        *pytest_args,
    ]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="conformance-bench-") as tmp:
        tmp_path = Path(tmp)
        for name in [r for r in RUNS if r in args.runs.split(",")]:
            junit = tmp_path / f"{name}.xml"
            cache = None if name == "ci" else tmp_path / "cache"
            wall, code, lines = run_suite(cache, junit, pytest_args)
            runs[name] = (wall, code, lines, totals(junit, "area"), totals(junit, "check"))
    print(f"tier {args.tier}, families {', '.join(families)}; {os.cpu_count()} CPU cores")
    for name, (wall, code, lines, _, _) in runs.items():
        print(f"{name:>4}: {wall:7.1f} s wall, exit {code}")
        for line in lines:
            print(f"        {line}")
    for index, title in ((3, "by area"), (4, "by check")):
        print(f"{title}: tests, then per run seconds and compiles (compile seconds)")
        first = next(iter(runs.values()))
        for key, (count, *_) in first[index].items():
            cells = {
                name: f"{run[index][key][1]:7.1f} s {run[index][key][2]:>5} "
                f"({run[index][key][3]:6.1f} s)"
                for name, run in runs.items()
                if key in run[index]
            }
            row = "  ".join(f"{name} {cell}" for name, cell in cells.items())
            print(f"  {key:<22} {count:>3}  {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
