"""How long compiled programs live in a run: one scope per group of tests, released between.

Tests of one group (same family, layer layout and mesh) run together and share runners,
trainers and their executables through the active :class:`~conformance.core.scope.Scope`;
when the group changes, the scope is released, so a run's memory mappings and RSS stay
bounded by one group's programs however many families, meshes and layouts it covers.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from conformance.core import scope
from conformance.pytest_plugin import workers
from conformance.pytest_plugin.plan import Group, group_of

RELEASED = "released_s"
"""The user property of a test whose teardown released the scope: the seconds it took.

Progress lines keep it out of the test's own seconds and say it apart."""


class ScopePerGroup:
    """Releases compiled programs when the next test belongs to another group, or sooner.

    A group whose programs alone pass half of the kernel's mapping limit
    (``vm.max_map_count``: :func:`~conformance.core.scope.mapping_budget`) is released
    early, between two of its tests: its later tests recompile what they share, and the
    run does not crash. Host results
    (:func:`~conformance.core.scope.kept`, such as one-device references) stay while the
    family and layout stay, so each is computed once per family and layout.
    """

    def __init__(self) -> None:
        self.budget = scope.mapping_budget()
        self.releases = 0
        self.early = 0
        self.peak = 0

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        """After a test's teardown, release the scope at a group boundary or over budget."""
        try:
            return (yield)
        finally:
            keep_results = self._release_now(group_of(item), group_of(nextitem))
            if keep_results is not None:
                start = time.perf_counter()
                scope.release(keep_results=keep_results)
                item.user_properties.append((RELEASED, round(time.perf_counter() - start, 3)))

    def _release_now(self, group: Group | None, following: Group | None) -> bool | None:
        """Whether to release the scope now, keeping host results (True) or not (False)."""
        mappings = scope.mapping_count() or 0
        self.peak = max(self.peak, mappings)
        if group is not None and group != following:
            self.releases += 1
            return following is not None and following.same_model(group)
        if self.budget is not None and mappings > self.budget:
            self.early += 1
            return True
        return None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """On an xdist worker, hand its releases and peak to the controller."""
        workers.send(session.config, "releases", [self.releases, self.early, self.peak])

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """On the xdist controller, count a finished worker's releases and peak in."""
        if (counts := workers.received(node, "releases")) is not None:
            releases, early, peak = counts
            self.releases, self.early = self.releases + releases, self.early + early
            self.peak = max(self.peak, peak)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """How often programs were released and the peak memory-mapping count seen.

        Under xdist: the releases of every worker, and the highest peak of any one.
        """
        if self.releases or self.early:
            limit = scope.mapping_limit()
            terminalreporter.write_line(
                f"compiled programs released {self.releases} time(s) between test groups and "
                f"{self.early} time(s) early; peak memory mappings {self.peak} "
                f"(limit {limit})"
            )
