"""The pytest plugin of a multi-controller run: every process runs the same tests alike.

Registered by :mod:`conformance.pytest_plugin.session` when the run has more than one process. It
stops the run on every process when the processes collected different tests (their
collectives would pair up wrongly and hang), and makes each test's outcome the same on
every process: a test fails everywhere if it failed on any process, so process 0, which
writes goldens, reports and the matrix, never records a pass another process refuted.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from conformance.core import distributed

_CODES = {"passed": 0, "skipped": 1, "failed": 2}


class MultiController:
    """Same tests, same order, same verdicts on every process."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Stop on every process, naming the difference, if the test lists differ."""
        found = distributed.differences([item.nodeid for item in session.items])
        if found:
            pytest.exit(
                "the processes of this multi-controller run collected different tests, so "
                "they cannot run in step; give every process the same command and files:\n" + found,
                returncode=pytest.ExitCode.USAGE_ERROR,
            )

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Fail a test's setup or call on every process if it failed on any process.

        Stops the run if the processes are out of step (not at the same test and phase):
        a process failed somewhere the others did not, and their collectives no longer
        pair up.
        """
        report = yield
        if call.when == "teardown":
            return report
        place = distributed.checksum(f"{item.nodeid} {call.when}")
        found = distributed.gather_ints([place, _CODES[report.outcome]])
        if any(p != place for p, _ in found):
            lost = [i for i, (p, _) in enumerate(found) if p != place]
            pytest.exit(
                f"process {jax.process_index()} is at {item.nodeid} ({call.when}) and process(es) "
                f"{', '.join(map(str, lost))} elsewhere: the processes are out of step, after a "
                "failure on some of them only; see each process's log",
                returncode=pytest.ExitCode.INTERNAL_ERROR,
            )
        codes = [code for _, code in found]
        if len(set(codes)) > 1:
            outcomes = {code: name for name, code in _CODES.items()}
            where = ", ".join(f"process {i} {outcomes[c]}" for i, c in enumerate(codes))
            here = report.longreprtext if report.failed else ""
            report.outcome = "failed"
            report.longrepr = (
                f"the processes disagree on {call.when}: {where} "
                "(each process's log holds its own failure text)"
                + (f"\nthis process (process {jax.process_index()}):\n{here}" if here else "")
            )
        return report

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        """Which process this is, of how many, and who writes the run's files."""
        return [
            f"conformance: multi-controller run, process {jax.process_index()} of "
            f"{jax.process_count()}; {jax.local_device_count()} of {jax.device_count()} "
            "devices here; process 0 writes goldens, reports and the matrix"
        ]
