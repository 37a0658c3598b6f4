"""Report the conformance suite's wall time, cold and with a warm compilation cache.

Runs the suite twice in fresh processes sharing a new persistent compilation cache:
first cold (empty cache), then warm. Prints total wall time per run, the warm time per
area (suite module: forward, train step, checkpoint, decode, ...) and per check (summed
test durations from pytest's JUnit XML). Extra arguments are passed to
pytest, e.g. ``python scripts/benchmark.py -k forward`` or ``-n 2``.

This is a benchmark, not a test: it never fails on a time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

SUITE = "conformance/suite"


def run_suite(cache_dir: Path, junit: Path, pytest_args: list[str]) -> tuple[float, int]:
    """Run the suite once; return (wall seconds, pytest exit code)."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    command = [
        sys.executable,
        "-m",
        "pytest",
        SUITE,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *pytest_args,
    ]
    start = time.perf_counter()
    code = subprocess.call(command, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start, code


def totals(junit: Path, key: str) -> dict[str, tuple[int, float]]:
    """``{name: (tests, seconds)}`` from a JUnit XML report, by check or by area.

    A check is a test function without ``test_``; an area is a suite module without
    ``test_`` (``decode`` for ``conformance/suite/test_decode.py``).
    """
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for case in ET.parse(junit).iter("testcase"):
        if key == "check":
            name = case.get("name", "").split("[")[0].removeprefix("test_")
        else:
            name = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_")
        sums[name][0] += 1
        sums[name][1] += float(case.get("time", 0))
    return {k: (int(n), t) for k, (n, t) in sorted(sums.items())}


def main() -> int:
    """Run cold then warm and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="conformance-bench-") as tmp:
        tmp_path = Path(tmp)
        cold, cold_code = run_suite(tmp_path / "cache", tmp_path / "cold.xml", pytest_args)
        warm, warm_code = run_suite(tmp_path / "cache", tmp_path / "warm.xml", pytest_args)
        areas = totals(tmp_path / "warm.xml", "area")
        checks = totals(tmp_path / "warm.xml", "check")
    print(
        f"suite wall time: cold {cold:.1f} s (exit {cold_code}), "
        f"warm cache {warm:.1f} s (exit {warm_code}); {os.cpu_count()} CPU cores"
    )
    for title, table in (("by area", areas), ("by check", checks)):
        print(title)
        for name, (count, seconds) in table.items():
            print(f"  {name:<22} {count:>3} tests  {seconds:7.1f} s warm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
