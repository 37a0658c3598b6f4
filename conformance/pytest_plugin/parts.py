"""The plugin's working parts, registered for a conformance run once it is set up.

:func:`register` adds each hook object the run needs to pytest's plugin manager: the
suite's collection (:mod:`~conformance.pytest_plugin.suite`), the matrix, the scopes
that release compiled programs, the compile clock, the progress lines, the report
files, and the multi-controller and pytest-xdist parts. They read the run's
:class:`~conformance.pytest_plugin.session.Settings`; :mod:`session` imports none of
them, so the package's imports run one way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.core import distributed
from conformance.pytest_plugin import options, suite, workers
from conformance.pytest_plugin.matrix import SessionReport
from conformance.pytest_plugin.multicontroller import MultiController
from conformance.pytest_plugin.progress import CompileClock, ControllerProgress, Progress
from conformance.pytest_plugin.scopes import ScopePerGroup
from conformance.pytest_plugin.session import Settings


def register(config: pytest.Config, run: Settings) -> None:
    """Register the plugin's working parts for ``run``: each once, under its own name."""
    manager = config.pluginmanager
    if distributed.is_multiprocess():
        manager.register(MultiController(), "conformance-processes")
    manager.register(suite, "conformance-suite")
    if workers.is_worker(config):
        manager.register(workers.WholeGroups(), "conformance-whole-groups")
    if not workers.is_worker(config):  # its hook runs only where xdist starts workers
        handed = {"goldens": run.goldens.describe(list(run.families))}
        manager.register(workers.Handover(handed), "conformance-handover")
    manager.register(SessionReport(config), "conformance-report")
    manager.register(ScopePerGroup(), "conformance-scopes")
    manager.register(CompileClock(), "conformance-compiles")
    if (directory := options.value(config, "report")) is not None:
        from conformance.report.collector import ReportCollector
        from conformance.report.model import header

        meshes = [m.id for m in run.run_meshes]
        families = [f.name for f in run.families]
        head = header(run.tier.name, meshes, run.xla_opt, families, run.bridged())
        command = [str(config.invocation_params.dir), *config.invocation_params.args]
        writes = distributed.is_leader()
        collector = ReportCollector(Path(directory).resolve(), head, command, writes=writes)
        manager.register(collector, "conformance-report-files")
    if options.value(config, "progress"):
        lines = run.header() if config.option.verbose < 0 and not workers.is_worker(config) else []
        progress = (
            ControllerProgress(lines)
            if workers.is_controller(config)
            else Progress(lines, suite.progress_label)
        )
        manager.register(progress, "conformance-progress")
