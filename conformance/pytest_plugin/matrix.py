"""The run's verdict per family and check: the agreement matrix, and unused goldens.

:class:`SessionReport` counts each planned test's outcome under its ``(family, check)``
cell, prints the matrix at the end (process 0 of a multi-controller run), and fails the
session when a golden on disk is claimed by no collected test.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from conformance.contract import Pair
from conformance.core import distributed
from conformance.pytest_plugin import workers
from conformance.pytest_plugin.goldens import WRITTEN, unused_goldens
from conformance.pytest_plugin.session import settings
from conformance.report.collector import fold
from conformance.report.model import CELL_LEGEND, matrix_rows

CLAIMED = pytest.StashKey[set[Path]]()
"""Golden files claimed by a collected test (set during collection)."""


class SessionReport:
    """Per-session results: the family x check matrix and the unused-goldens verdict."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {}
        """``{node id: ((family, check), (outcome, message))}``, folded phase by phase."""
        self.unused: list[Path] = []
        config.stash[CLAIMED] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold each phase of a suite test into its outcome, as the report does."""
        key = dict(report.user_properties).get("conformance")
        if key is not None:
            _, test = self.tests.get(report.nodeid, (None, ("passed", "")))
            self.tests[report.nodeid] = (tuple(key), fold(test, report))

    @property
    def results(self) -> dict[tuple[str, str], dict[str, int]]:
        """Outcome counts per ``(family, check)`` cell."""
        counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for key, (test_outcome, _) in self.tests.values():
            counts[key][test_outcome] += 1
        return counts

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """On the xdist controller, take the goldens a finished worker's collection claimed."""
        self.config.stash[CLAIMED].update(map(Path, workers.received(node, "claimed", [])))
        written = self.config.stash.setdefault(WRITTEN, set())
        written.update(map(Path, workers.received(node, "written", [])))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Fail the session if a golden is unused; an xdist worker hands its claims over.

        Every worker collects the whole run, so any one worker's claims are all of them.
        """
        if workers.is_worker(self.config):
            workers.send(self.config, "claimed", sorted(map(str, self.config.stash[CLAIMED])))
            written = self.config.stash.get(WRITTEN, set())
            workers.send(self.config, "written", sorted(map(str, written)))
            return
        if session.exitstatus not in (0, 1):
            return
        run = settings(self.config)
        families = {f.name for f in run.families}
        claimed = self.config.stash[CLAIMED]
        self.unused = sorted(
            path
            for root in self.roots()
            for path in unused_goldens(
                self.config, root, {p for p in claimed if p.is_relative_to(root)}, families
            )
        )
        if self.unused:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Print the agreement matrix (process 0 only) and any unused goldens."""
        results = self.results
        if results and not distributed.is_leader():
            terminalreporter.write_line("agreement matrix: in process 0's output")
        elif results:
            title = f"Linen/NNX agreement ({CELL_LEGEND})"
            terminalreporter.section(title)
            bridged = settings(self.config).bridged()
            for line in agreement_matrix(results, bridged):
                terminalreporter.write_line(line)
            recorded = settings(self.config).recorded()
            if recorded and any(check.startswith("recorded_") for _, check in results):
                terminalreporter.write_line("recorded_* compare " + "; ".join(recorded))
            for line in pair_lines({check for _, check in results}):
                terminalreporter.write_line(line)
        if self.config.option.update_snapshots and distributed.is_leader():
            for line in written_lines(self.config.stash.get(WRITTEN, set()), self.roots()):
                terminalreporter.write_line(line)
        if self.unused:
            terminalreporter.section("unused goldens", red=True)
            terminalreporter.write_line(
                "no collected test claims these files; if their tests were removed or renamed "
                "on purpose, delete them with `git rm` in a reviewed commit:"
            )
            here = self.config.invocation_params.dir
            for path in self.unused:
                shown = path.relative_to(here) if path.is_relative_to(here) else path
                terminalreporter.write_line(f"  {shown}")

    def roots(self) -> list[Path]:
        """The directories this run keeps goldens in."""
        run = settings(self.config)
        return run.goldens.roots(list(run.families))


_MODE_CHECKS = {"tree_mode": Pair.GRAPH_TREE, "explicit_sharding": Pair.AUTO_EXPLICIT}
"""The checks comparing two modes of the NNX model, each with the pair it compares."""


def pair_lines(rows: set[str]) -> list[str]:
    """A line per mode pair among the matrix's ``rows``: what its rows compare with what."""
    lines = []
    for pair in Pair:
        named = sorted(
            row for row in rows if row.endswith(f" {pair.id}") or _MODE_CHECKS.get(row) == pair
        )
        if pair.id and named:
            lines.append(f"{', '.join(named)}: {pair.label} (no Linen)")
    return lines


def written_lines(written: set[Path], roots: Sequence[Path]) -> list[str]:
    """What a ``--snapshot-update`` run did, per goldens directory: how many, and where.

    A golden counts once written or found unchanged; a directory none went to says so.
    """
    lines = []
    for root in roots:
        count = sum(1 for path in written if path.is_relative_to(root))
        if count:
            lines.append(f"--snapshot-update: {count} golden(s) written or unchanged under {root}")
    return lines or ["--snapshot-update: no golden was written (no golden test ran)"]


def agreement_matrix(
    results: dict[tuple[str, str], dict[str, int]],
    bridged: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The check x family table: a row per check, a column per family.

    It fits a terminal (three families within 100 columns); a cell reads
    ``agreed/run (extras)`` (:data:`CELL_LEGEND`). Families with a ``bridged`` side are
    named in a line under it: their parity tests a bridge around one model, not two
    implementations.
    """
    rows = [list(column) for column in zip(*matrix_rows(results), strict=True)]
    rows[0][0] = "check"
    families = rows[0][1:]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    sides = [f"{f} ({', '.join(bridged[f])})" for f in families if (bridged or {}).get(f)]
    if sides:
        lines.append(f"bridged: {'; '.join(sides)}: parity tests the bridge around one model")
    return lines
