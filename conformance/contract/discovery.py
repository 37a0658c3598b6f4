"""The family registry: families found through the ``conformance.families`` entry points.

The harness never imports a concrete family: built-in families and third-party ones
alike are found through the entry point group, whose values name either a
:class:`~conformance.contract.family.Family` instance or a zero-argument callable
returning one.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from conformance.contract.family import Family
from conformance.contract.validate import validate
from conformance.contract.values import FamilyError

ENTRY_POINT_GROUP = "conformance.families"


def _load(entry_point: Any) -> Family:
    obj = entry_point.load()
    family = obj() if callable(obj) and not isinstance(obj, Family) else obj
    if not isinstance(family, Family):
        raise FamilyError(
            f"entry point {entry_point.name!r} = {entry_point.value!r} in group "
            f"{ENTRY_POINT_GROUP!r} gave {type(family).__name__}, not a conformance Family"
        )
    if family.name != entry_point.name:
        raise FamilyError(
            f"entry point {entry_point.name!r} = {entry_point.value!r} registers a family "
            f"named {family.name!r}; the two names must agree"
        )
    return validate(family)


DISTRIBUTION = "linen-nnx-conformance"
"""The distribution that ships the built-in families (gpt3, llama, maxtext-*)."""


@functools.cache
def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


@functools.cache
def _loaded(name: str) -> Family:
    return _load(_entry_points()[name])


def builtin(name: str) -> bool:
    """Whether the family registered as ``name`` is one this package ships."""
    dist = getattr(_entry_points()[name], "dist", None)
    return dist is not None and dist.name == DISTRIBUTION


def registry(*, include_builtin: bool = True) -> Mapping[str, Family]:
    """The families reachable through the entry point group, by name, sorted.

    ``include_builtin=False`` leaves out those this package ships (:func:`builtin`),
    without loading them.
    """
    names = sorted(n for n in _entry_points() if include_builtin or not builtin(n))
    return {name: _loaded(name) for name in names}


def select(patterns: Sequence[str], *, include_builtin: bool = True) -> list[Family]:
    """The families ``patterns`` name, in order and each once; all when it is empty.

    A pattern is a family name or an ``fnmatch`` glob such as ``maxtext-*``; one that
    matches nothing raises :class:`FamilyError` listing the known names. With
    ``include_builtin=False``, an empty ``patterns`` selects only third-party families
    (names and globs still reach every family).
    """
    if not patterns:
        return list(registry(include_builtin=include_builtin).values())
    chosen: dict[str, Family] = {}
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            chosen.setdefault(pattern, get(pattern))
            continue
        names = fnmatch.filter(_entry_points(), pattern)
        if not names:
            raise FamilyError(f"no family matches {pattern!r}; known families: {_known()}")
        for name in sorted(names):
            chosen.setdefault(name, _loaded(name))
    return list(chosen.values())


def _known() -> str:
    return ", ".join(sorted(_entry_points())) or "none (is the package installed?)"


def get(name: str) -> Family:
    """Return the family registered as ``name``; a :class:`FamilyError` lists the known ones."""
    if name not in _entry_points():
        raise FamilyError(f"unknown family {name!r}; known families: {_known()}")
    return _loaded(name)
