"""Checks a model zoo registers itself, through the ``conformance.checks`` entry points.

An entry point's value names a :class:`~conformance.checks.registry.check.Check` whose
name is the entry point's. Such a check runs like a built-in one (parametrized from its
entry, skipped where a family lacks what it needs, a row of the matrix and the reports)
and is collected from ``conformance.suite.test_zoo``. An entry point that does not load,
gives something else, or clashes with another check is a problem the plugin reports as
a usage error before any test; the checks that load still register.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import NamedTuple

from conformance.checks.registry.check import AXES, Check

ENTRY_POINT_GROUP = "conformance.checks"

ZOO_SUITE = "zoo"
"""The suite module every zoo check is collected from: ``conformance.suite.test_zoo``."""


def _problem(entry: EntryPoint, found: object, taken: Mapping[str, Check]) -> str | None:
    """Why ``found``, loaded from ``entry``, cannot register, or ``None``."""
    where = f"check entry point {entry.name!r} = {entry.value!r}"
    if not isinstance(found, Check):
        return f"{where} gave {type(found).__name__}, not a conformance Check"
    if found.name != entry.name:
        return f"{where} gave the check {found.name!r}: name the entry point after its check"
    if found.name in taken:
        return f"{where}: a check called {found.name!r} is already registered"
    if found.run is None:
        return f"{where}: the check has no function to run"
    if unknown := [axis for axis in found.axes if axis not in AXES]:
        return f"{where}: unknown axes {unknown}; axes are {', '.join(AXES)}"
    if list(found.axes) != sorted(found.axes, key=AXES.index):
        return f"{where}: axes {list(found.axes)} are not in test-id order ({', '.join(AXES)})"
    return None


class ZooChecks(NamedTuple):
    """What the installed zoos register: their checks, and why some could not register."""

    checks: dict[str, Check]
    """The checks that registered, by name."""
    problems: tuple[str, ...]
    """Why an entry point could not register, one line each."""


def zoo_checks(
    builtin: Mapping[str, Check], entries: Iterable[EntryPoint] | None = None
) -> ZooChecks:
    """The checks installed zoos register, by name, and the problems of those that cannot.

    ``entries`` defaults to the installed ``conformance.checks`` entry points. Each check
    is filed under :data:`ZOO_SUITE`; none replaces a built-in or another zoo's check.
    """
    if entries is None:
        entries = entry_points(group=ENTRY_POINT_GROUP)
    checks: dict[str, Check] = {}
    problems: list[str] = []
    for entry in sorted(entries, key=lambda e: (e.name, e.value)):
        try:
            found = entry.load()
        except Exception as err:  # a zoo's import error, reported as one line
            problems.append(
                f"check entry point {entry.name!r} = {entry.value!r} fails to load: {err!r}"
            )
            continue
        if problem := _problem(entry, found, {**builtin, **checks}):
            problems.append(problem)
            continue
        checks[found.name] = dataclasses.replace(found, suite=ZOO_SUITE)
    return ZooChecks(checks, tuple(problems))
