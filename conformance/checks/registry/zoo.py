"""Checks a model zoo registers itself, through the ``conformance.checks`` entry points.

An entry point's value names a :class:`~conformance.checks.registry.check.Check` whose
name is the entry point's. Such a check runs like a built-in one (parametrized from its
entry, skipped where a family lacks what it needs, a row of the matrix and the reports)
and is collected from ``conformance.suite.test_zoo``. An entry point that does not load,
gives something else, or clashes with another check is a problem the plugin reports as
a usage error before any test.

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

from conformance.checks.registry.check import AXES, ZOO_SUITE, Check
from conformance.checks.registry.table import BUILTIN

CHECK_ENTRY_POINT_GROUP = "conformance.checks"

_MESH_AXIS = {"each": "mesh", "topology": "topology", "tpu": "tpu"}
"""The axis a check's ``where`` takes its mesh from."""


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
    axes = list(found.axes)
    if unknown := [axis for axis in axes if axis not in AXES]:
        return f"{where}: unknown axes {unknown}; axes are {', '.join(AXES)}"
    if axes != sorted(set(axes), key=AXES.index):
        return f"{where}: axes {axes} are not each once in test-id order ({', '.join(AXES)})"
    if axes[:1] != ["family"]:
        return f"{where}: its axes must start with 'family'"
    if (axis := _MESH_AXIS.get(found.where)) and axis not in axes:
        return f"{where}: a check run where={found.where!r} needs the axis {axis!r}"
    if found.references and "recorded" not in axes:
        return f"{where}: a check of recorded references needs the axis 'recorded'"
    if extra := [axis for axis in found.given if axis not in axes]:
        return f"{where}: given axes {extra} are not among its axes"
    if clash := [name for name, _ in found.params if name in AXES]:
        return f"{where}: parameters {clash} are named like axes"
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
        checks[found.name] = dataclasses.replace(found, suite=ZOO_SUITE)
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
