"""What a run reports as it goes: progress lines, and how much of it was compilation.

Both are pytest plugins that :mod:`conformance.pytest_plugin.session` registers; neither knows about
families or checks beyond the label it is given for each test.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import pytest

from conformance.core import programs

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""jax's event for one program made executable (compiled, or read from the cache)."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""jax's event for one executable read back from the persistent compilation cache."""


class CompileClock:
    """Counts the programs XLA makes executable and their seconds, per test and per run.

    Each test gets the user properties ``compiles``, ``cache_hits`` and ``compile_s``
    (seconds), which JUnit XML reports carry (``-o junit_family=xunit1``).
    """

    def __init__(self) -> None:
        self.count, self.hits, self.seconds = 0, 0, 0.0
        self.wall = time.perf_counter()
        self.start: tuple[int, int, float] = (0, 0, 0.0)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def _on_event(self, event: str, **_: Any) -> None:
        if event == CACHE_HIT_EVENT:
            self.hits += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Start counting for ``item``."""
        self.start = (self.count, self.hits, self.seconds)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Attach the test's counts before its last report, which JUnit XML reads."""
        if call.when == "teardown":
            count, hits, seconds = self.start
            item.user_properties += [
                ("compiles", self.count - count),
                ("cache_hits", self.hits - hits),
                ("compile_s", round(self.seconds - seconds, 3)),
            ]
        return (yield)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Programs compiled (and how many distinct), and the share of the run it took."""
        if self.count:
            wall = time.perf_counter() - self.wall
            terminalreporter.write_line(
                f"{programs.summary()}; XLA made {self.count} executable "
                f"({self.hits} read from the persistent cache) in {self.seconds:.1f} s "
                f"of {wall:.1f} s wall"
            )


class Progress:
    """One line per run of consecutive tests with the same label, instead of a character each.

    ``label(item)`` names what a test belongs to (for the suite: family, layout, mesh
    and check); a line opens when the label changes and closes with the outcomes and
    the seconds it took. ``header`` lines are written first (pytest shows none when -q).
    """

    def __init__(self, header: Sequence[str], label: Callable[[pytest.Item], str]) -> None:
        self.header = list(header)
        self.label = label
        self.writer: Any = None
        self.items: dict[str, pytest.Item] = {}
        self.done = 0
        self.line: str | None = None
        self.counts: dict[str, int] = defaultdict(int)
        self.started = 0.0

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Find the terminal to write to."""
        self.writer = session.config.pluginmanager.get_plugin("terminalreporter")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Remember the tests that will run, and say what the run covers."""
        self.items = {item.nodeid: item for item in session.items}
        for line in self.header:
            self.writer.write_line(line)
        self.writer.write_line(f"conformance: {len(self.items)} tests to run")

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        """No per-test character: the progress line says it all."""
        if report.when == "call" or (report.when == "setup" and report.skipped):
            outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
            return outcome, "", ""
        return None

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
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
            self.counts[outcome] += 1
            self.done += 1

    def pytest_sessionfinish(self) -> None:
        """Close the last line."""
        self._close()

    def _close(self) -> None:
        if self.line is None:
            return
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        self.writer.write_line(f"{outcomes} ({time.perf_counter() - self.started:.1f} s)")
        self.line, self.counts = None, defaultdict(int)
