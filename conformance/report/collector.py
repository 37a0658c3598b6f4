"""The pytest plugin that records a run for its report (``--conformance-report DIR``).

It collects each test's outcome, duration, failure text and the measurements its checks
emitted (:mod:`conformance.core.records`), writes the process's part when the session ends
and re-renders the merged report. Under pytest-xdist the workers measure and the
controller writes: measurements travel on the test reports.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from conformance.core import records
from conformance.report import render
from conformance.report.model import (
    AREA,
    SPENT,
    Json,
    RecordedTest,
    ReportError,
    case_of,
    costs_json,
    layouts_json,
    measurement_json,
    plain_nodeid,
)

_MEASURED = pytest.StashKey[list[records.Record]]()


def outcome(report: pytest.TestReport) -> tuple[str, str] | None:
    """``(outcome, message)`` a test phase decides, or ``None`` if it decides nothing.

    The one rule every count of the run follows (progress lines, the matrix, the report):
    a call decides (``passed``, ``failed``, ``skipped``, or ``xfailed``/``xpassed`` when
    the test was expected to fail); setup and teardown decide only when they did not pass
    (``error`` when they raised, ``skipped`` when the test was skipped before its call).
    """
    decisive = report.when == "call" or not report.passed
    if not decisive:
        return None
    if hasattr(report, "wasxfail"):
        return ("xfailed", report.wasxfail) if report.skipped else ("xpassed", report.wasxfail)
    if report.failed:
        return ("failed" if report.when == "call" else "error"), report.longreprtext
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return "skipped", reason.removeprefix("Skipped: ")
    return "passed", ""


def fold(test: tuple[str, str], report: pytest.TestReport) -> tuple[str, str]:
    """A test's ``(outcome, message)`` with one more phase in (it starts ``("passed", "")``).

    The first phase that decides anything but a pass or a skip stands: a failed call
    stays failed through its teardown; a passed call whose teardown raised is an error.
    """
    decided = outcome(report)
    return decided if decided is not None and test[0] in ("passed", "skipped") else test


class ReportCollector:
    """Records every test of this process; writes its part and the merged report at the end.

    Without ``writes`` it records (so checks measure alike on every process of a
    multi-controller run) and writes nothing: process 0 writes for the run.
    """

    def __init__(self, root: Path, header: Json, command: list[str], writes: bool = True) -> None:
        self.root = root
        self.writes = writes
        self.run: Json = {"command": command, **header}
        self.tests: dict[str, RecordedTest] = {}
        self.started = time.time()
        self.written: Json | None = None
        self.error: str | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        """Collect the measurements and costs the test's checks emit."""
        with records.collecting() as found:
            try:
                return (yield)
            finally:
                item.stash[_MEASURED] = found

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Put the call's records on its report, as JSON values (they cross processes)."""
        report = yield
        if call.when == "call":
            found = item.stash.get(_MEASURED, [])
            report.conformance_measurements = [
                measurement_json(m) for m in found if isinstance(m, records.Measurement)
            ]
            report.conformance_costs = [
                costs_json(c) for c in found if isinstance(c, records.Costs)
            ]
            report.conformance_layouts = [
                layouts_json(t) for t in found if isinstance(t, records.Layouts)
            ]
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold one phase of a test into its record."""
        nodeid = plain_nodeid(report.nodeid)
        record = self.tests.setdefault(nodeid, RecordedTest(nodeid))
        properties = dict(report.user_properties)
        key = properties.get("conformance")
        if key is not None:
            record.family, record.check = key
            record.case = case_of(nodeid, record.family)
            record.area = properties.get(AREA)
        if report.when == "teardown":
            record.compiles, record.compile_s, record.trace_s = (
                properties.get(name, 0) for name in SPENT
            )
        record.duration_s += report.duration
        record.measurements += getattr(report, "conformance_measurements", [])
        record.costs += getattr(report, "conformance_costs", [])
        record.layouts += getattr(report, "conformance_layouts", [])
        record.outcome, record.message = fold((record.outcome, record.message), report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write this process's part, then the report merged from every part in the directory.

        Runs last, so the exit status includes the plugin's own verdicts (unused goldens).
        """
        if hasattr(session.config, "workerinput") or not self.writes:
            return
        self.run |= {
            "started": datetime.datetime.fromtimestamp(self.started, datetime.UTC).isoformat(),
            "duration_s": round(time.time() - self.started, 3),
            "exit_status": int(session.exitstatus),
        }
        try:
            self.written = render.add_part(self.root, self.run, self.tests.values())
        except (OSError, ReportError) as err:
            # A report CI cannot publish must not pass unnoticed; the tests' own verdicts
            # stand, so only a passing run turns into a failing one.
            self.error = f"{err}"
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Say where the report is and how much it covers."""
        if self.error is not None:
            terminalreporter.write_line(
                f"conformance report: not written to {self.root}/: {self.error} (remove the "
                "directory, or the part named, and run again)",
                red=True,
            )
        if self.written is not None:
            runs, tests = len(self.written["runs"]), len(self.written["tests"])
            files = ", ".join(render.FILES)
            terminalreporter.write_line(
                f"conformance report: {self.root}/ ({files}): {tests} tests from {runs} process(es)"
            )
