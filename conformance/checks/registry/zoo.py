"""Checks a model zoo registers itself, through the ``conformance.checks`` entry points.

An entry point's value names a function declared with
:func:`~conformance.checks.declare.declare` (or a :class:`~conformance.checks.declare.Check`)
whose check is named like the entry point. Such a check runs like a built-in one
(parametrized from its declaration, skipped where a family lacks what it needs, a row of
the matrix and the reports) and is collected from ``conformance.suite.test_zoo``. An
entry point that does not load, gives something else, or clashes with another check is
a problem the plugin reports as a usage error before any test.

The entry points are loaded once, when :func:`checks` is first called: in a pytest run,
after the plugin has configured JAX's devices, so a zoo module that touches JAX at
import sees them. A zoo's check module may import anything of the harness.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import NamedTuple

from conformance.checks.declare import ZOO_SUITE, Check, checks_of, unfit
from conformance.checks.registry.table import BUILTIN

CHECK_ENTRY_POINT_GROUP = "conformance.checks"


def _problem(entry: EntryPoint, found: object, taken: Mapping[str, Check]) -> str | None:
    """Why ``found``, loaded from ``entry``, cannot register, or ``None``."""
    where = f"check entry point {entry.name!r} = {entry.value!r}"
    declared = checks_of(found)
    if not declared:
        return f"{where} gave {type(found).__name__}, not a conformance Check or declared check"
    named = [check for check in declared if check.name == entry.name]
    if not named:
        names = ", ".join(repr(check.name) for check in declared)
        return f"{where} gave the check {names}: name the entry point after its check"
    if entry.name in taken:
        return f"{where}: a check called {entry.name!r} is already registered"
    if problem := unfit(named[0]):
        return f"{where}: {problem}"
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
        entries = entry_points(group=CHECK_ENTRY_POINT_GROUP)
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
        (check,) = (check for check in checks_of(found) if check.name == entry.name)
        checks[check.name] = dataclasses.replace(check, suite=ZOO_SUITE)
    return ZooChecks(checks, tuple(problems))


@functools.cache
def installed() -> ZooChecks:
    """The checks the installed zoos register, loaded once, on first use."""
    return zoo_checks(BUILTIN)


@functools.cache
def checks() -> Mapping[str, Check]:
    """Every registered check, by name: the built-in ones, then the installed zoos'.

    Made once, read-only: a run asks for it once per test and per declared divergence.
    """
    return MappingProxyType({**BUILTIN, **installed().checks})
