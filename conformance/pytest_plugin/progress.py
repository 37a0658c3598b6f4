"""What a run reports as it goes: progress lines, and how much of it was compilation.

Both are pytest plugins that :mod:`conformance.pytest_plugin.session` registers; neither knows about
families or checks beyond the label it is given for each test. Under pytest-xdist
(``-n N``) the workers count and label, and the controller prints: the workers' counts
reach it when they finish (:mod:`conformance.pytest_plugin.workers`), each test's label
with its reports.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import pytest

from conformance.core import programs
from conformance.pytest_plugin import workers
from conformance.pytest_plugin.scopes import RELEASED
from conformance.report.collector import outcome
from conformance.report.model import SPENT

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""jax's event for one program made executable (compiled, or read from the cache)."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""jax's event for one executable read back from the persistent compilation cache."""
TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
"""jax's events for tracing a function to a jaxpr and lowering it: a test's trace time.
A jitted function traced inside another's trace is timed within it too, so a test's
trace seconds are the union of these intervals, not their sum."""
LABEL = "progress"
"""The user property a worker's test carries its progress label in."""


class CompileClock:
    """Counts the programs XLA makes executable and their seconds, per test and per run.

    Each test gets the user properties ``compiles``, ``cache_hits``, ``compile_s`` and
    ``trace_s`` (seconds tracing and lowering), which the report sums per check area and
    JUnit XML reports carry (``-o junit_family=xunit1``).
    """

    def __init__(self) -> None:
        self.count, self.hits, self.seconds = 0, 0, 0.0
        self.workers = 0
        self.wall = time.perf_counter()
        self.start: tuple[int, int, float] = (0, 0, 0.0)
        self.traces: list[tuple[float, float]] = []
        """The current test's trace and lowering intervals, ``(start, end)``."""
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration
        elif event in TRACE_EVENTS:
            end = time.perf_counter()
            self.traces.append((end - duration, end))

    def _on_event(self, event: str, **_: Any) -> None:
        if event == CACHE_HIT_EVENT:
            self.hits += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Start counting for ``item``."""
        self.start = (self.count, self.hits, self.seconds)
        self.traces = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Attach the test's counts before its last report, which JUnit XML reads."""
        if call.when == "teardown":
            count, hits, seconds = self.start
            compile_s, trace_s = self.seconds - seconds, covered(self.traces)
            spent = (self.count - count, round(compile_s, 3), round(trace_s, 3))
            item.user_properties += [
                *zip(SPENT, spent, strict=True),
                ("cache_hits", self.hits - hits),
            ]
        return (yield)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """On an xdist worker, hand what this process compiled to the controller."""
        if workers.is_worker(session.config):
            counts = {
                "xla": [self.count, self.hits, self.seconds],
                "programs": programs.COUNTS.as_data(),
            }
            workers.send(session.config, "compiles", counts)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """On the xdist controller, add what a finished worker compiled to the run's counts."""
        if (counts := workers.received(node, "compiles")) is not None:
            count, hits, seconds = counts["xla"]
            self.count, self.hits, self.seconds = (
                self.count + count,
                self.hits + hits,
                self.seconds + seconds,
            )
            self.workers += 1
            programs.COUNTS.add(counts["programs"])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Programs compiled (and how many distinct), and the share of the run it took.

        Under xdist the counts and seconds are the workers' sums (a program two workers
        compiled is one distinct program compiled twice).
        """
        if self.count:
            wall = time.perf_counter() - self.wall
            summed = f" (summed over {self.workers} workers)" if self.workers else ""
            terminalreporter.write_line(
                f"{programs.summary()}; XLA made {self.count} executable "
                f"({self.hits} read from the persistent cache) in {self.seconds:.1f} s{summed} "
                f"of {wall:.1f} s wall"
            )


def covered(intervals: Sequence[tuple[float, float]]) -> float:
    """The seconds the union of ``(start, end)`` intervals covers (nested ones count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class _Lines:
    """What both kinds of progress lines share: the terminal, and no per-test character."""

    writer: Any = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Find the terminal to write to."""
        self.writer = session.config.pluginmanager.get_plugin("terminalreporter")

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        """No per-test character: the progress line says it all."""
        if (decided := outcome(report)) is not None:
            return decided[0], "", ""
        return None


def _outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _released(report: pytest.TestReport) -> float:
    return float(dict(report.user_properties).get(RELEASED, 0.0))


def _timing(seconds: float, released: float, where: str = "") -> str:
    """A line's seconds, and apart from them any spent releasing the group's programs."""
    release = f", then {released:.1f} s releasing compiled programs" if released else ""
    return f"({seconds:.1f} s{where}{release})"


class Progress(_Lines):
    """One line per run of consecutive tests with the same label, instead of a character each.

    ``label(item)`` names what a test belongs to (for the suite: family, layout, mesh
    and check); a line opens when the label changes and closes with the outcomes and
    the seconds it took, without those spent releasing compiled programs after its last
    test (said apart). ``header`` lines are written first (pytest shows none when -q).
    """

    def __init__(self, header: Sequence[str], label: Callable[[pytest.Item], str]) -> None:
        self.header = list(header)
        self.label = label
        self.items: dict[str, pytest.Item] = {}
        self.done = 0
        self.line: str | None = None
        self.counts: dict[str, int] = defaultdict(int)
        self.started = 0.0
        self.released = 0.0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Remember the tests that will run, and say what the run covers.

        On an xdist worker, label each test instead, for the controller's lines.
        """
        if workers.is_worker(session.config):
            for item in session.items:
                item.user_properties.append((LABEL, self.label(item)))
            return
        self.items = {item.nodeid: item for item in session.items}
        for line in self.header:
            self.writer.write_line(line)
        self.writer.write_line(f"conformance: {len(self.items)} tests to run")

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Open a line when the label changes."""
        item = self.items.get(nodeid)
        if item is None:
            return
        label = self.label(item)
        if label != self.line:
            self._close()
            self.line, self.started = label, time.perf_counter()
            total = len(self.items)
            percent = 100 * self.done // max(total, 1)
            self.writer.write(f"[{self.done:>4}/{total} {percent:>3}%] {label} ")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count the outcome of each test on the open line."""
        if (decided := outcome(report)) is not None:
            self.counts[decided[0]] += 1
        if report.when == "teardown":
            self.done += 1
            self.released += _released(report)

    def pytest_sessionfinish(self) -> None:
        """Close the last line."""
        self._close()

    def _close(self) -> None:
        if self.line is None:
            return
        seconds = time.perf_counter() - self.started - self.released
        self.writer.write_line(f"{_outcomes(self.counts)} {_timing(seconds, self.released)}")
        self.line, self.counts, self.released = None, defaultdict(int), 0.0


class ControllerProgress(_Lines):
    """:class:`Progress` on a pytest-xdist controller: a whole line per run of one label.

    Each worker runs a group of tests in a row, but their reports interleave, so a line
    is written only when it closes (the worker moved to another label, or finished) and
    gives the seconds its tests took on their worker, those spent releasing compiled
    programs apart.
    """

    def __init__(self, header: Sequence[str]) -> None:
        self.header = list(header)
        self.total = 0
        self.done = 0
        self.open: dict[str, tuple[str, dict[str, int], float, float]] = {}
        """``{worker: (label, outcome counts, seconds, seconds releasing)}``, the line each
        worker has open."""

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Sequence[str]) -> None:
        """Say what the run covers once the first worker has collected it."""
        if self.total:
            return
        self.total = len(ids)
        for line in self.header:
            self.writer.write_line(line)
        self.writer.write_line(f"conformance: {self.total} tests to run on xdist workers")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count a worker's test under its label, closing the worker's previous line."""
        label = dict(report.user_properties).get(LABEL)
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if label is None or worker is None:
            return
        if (line := self.open.get(worker.id)) is None or line[0] != label:
            self._close(worker.id)
            line = self.open[worker.id] = (label, defaultdict(int), 0.0, 0.0)
        name, counts, seconds, released = line
        release = _released(report)
        self.open[worker.id] = (
            name,
            counts,
            seconds + report.duration - release,
            released + release,
        )
        if (decided := outcome(report)) is not None:
            counts[decided[0]] += 1
        if report.when == "teardown":
            self.done += 1

    def pytest_sessionfinish(self) -> None:
        """Close every worker's last line."""
        for worker in list(self.open):
            self._close(worker)

    def _close(self, worker: str) -> None:
        if (line := self.open.pop(worker, None)) is None:
            return
        label, counts, seconds, released = line
        percent = 100 * self.done // max(self.total, 1)
        where = f"[{self.done:>4}/{self.total} {percent:>3}%]"
        timing = _timing(seconds, released, f" on {worker}")
        self.writer.write_line(f"{where} {label} {_outcomes(counts)} {timing}")
