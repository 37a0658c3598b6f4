"""Known divergences held to the tests they mark: a typo is a usage error, not a no-op.

A family's :attr:`~conformance.contract.Family.known_divergences` are checked when the
suite is collected (:func:`divergence_problems`); the first edition's spelling, a mapping
keyed ``check[id fragment]``, still works and is shown in the second's
(:func:`first_edition_spellings`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence

from conformance.checks.registry import checks
from conformance.contract import Divergence, Family, FirstEditionKey, divergences
from conformance.core.sharding import parse_mesh
from conformance.pytest_plugin.options import DEFAULT_MESHES
from conformance.pytest_plugin.plan import Planned, plan
from conformance.pytest_plugin.session import Settings


def _wider(run: Settings) -> Settings:
    """``run`` on its meshes and the default ones: where a divergence may mark a test."""
    meshes = (*run.meshes, *(parse_mesh(m) for m in DEFAULT_MESHES))
    return dataclasses.replace(run, meshes=tuple(dict.fromkeys(meshes)))


def divergence_problems(
    family: Family, run: Settings, own: Mapping[str, Sequence[Planned]] | None = None
) -> list[str]:
    """Each of ``family``'s known divergences that can mark no test, a line each.

    A divergence names a registered check or one of the run's own tests (``own``: each
    test's name and its planned tests), narrowed to tests of ``family`` on the run's
    meshes or the default ones: by axis and parameter values (a
    :class:`~conformance.contract.Divergence`), or by a fragment of the test id (a
    first-edition ``check[fragment]`` key). Anything else is a typo that would silently
    mark nothing; so is a divergence each of whose tests earlier ones mark (the first that
    selects a test marks it, in either edition). A check with no
    test here (``tpu_compile`` without ``--tpu``) keeps its narrowing unchecked: it marks
    nothing in this run.
    """
    own = own or {}
    wider = _wider(run)
    registered = checks()
    typed, first_edition = divergences(family.known_divergences)
    found = []

    def tests(key: str, name: str) -> Sequence[Planned] | None:
        """The tests named ``name`` on ``family``; ``None`` after a problem if there are none."""
        if name in registered:
            return plan(registered[name], family, wider)
        if name in own:
            return [p for p in own[name] if p.family.name == family.name]
        close = difflib.get_close_matches(name, [*registered, *own], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        found.append(
            f"family {family.name!r} declares a known divergence {key}of {name!r}, "
            f"which is no check{hint}"
        )
        return None

    for index, divergence in enumerate(typed):
        planned = tests("", divergence.check)
        if planned:
            found += _unselected(family, divergence, planned)
            found += _shadowed(family, divergence, typed[:index], planned)
    for index, key in enumerate(first_edition):
        ids = sorted({p.id for p in tests(f"{key.key!r} ", key.check) or ()})
        if key.fragment is not None and ids and not any(key.fragment in i for i in ids):
            found.append(
                f"family {family.name!r} declares a known divergence {key.key!r}, but no test "
                f"of {key.check} has {key.fragment!r} in its id (e.g. {ids[0]!r})"
            )
        else:
            found += _shadowed_key(family, key, first_edition[:index], ids)
    return found


def _unselected(family: Family, divergence: Divergence, planned: Sequence[Planned]) -> list[str]:
    """What keeps ``divergence`` from selecting tests of ``planned``, a line per cause.

    A name that is no axis or parameter of the check, or a value (any one of a tuple's)
    that no test has.
    """
    head = f"family {family.name!r} declares a known divergence of {divergence.check}"
    names = {*planned[0].values, *planned[0].params}
    problems = []
    for name in divergence.where:
        if name not in names:
            has = ", ".join(sorted(names)) or "none"
            problems.append(f"{head} narrowed by {name!r}, no axis or parameter of it ({has})")
            continue
        seen = {p.parts.get(name) or str(p.by_name()[name]) for p in planned}
        for option in divergence.options(name):
            if not any(
                Divergence.matches(option, p.parts.get(name), p.by_name()[name]) for p in planned
            ):
                problems.append(
                    f"{head} where {name} is {option!r}, but no test of it on {family.name} is "
                    f"(its {name}: {', '.join(sorted(seen))})"
                )
    return problems


def _shadowed(
    family: Family,
    divergence: Divergence,
    before: Sequence[Divergence],
    planned: Sequence[Planned],
) -> list[str]:
    """Why ``divergence`` marks none of the tests it selects, if those ``before`` mark them all.

    The first divergence that selects a test marks it, so a later one whose tests are all
    taken would be a finding no run can hold to its reason or its words. (A check's tests
    are the product of its axes' and parameters' values, so a divergence each of whose
    values some test has selects a test.)
    """
    selected = [p for p in planned if divergence.selects(p.check.name, p.parts, p.by_name())]
    taken = _marked_first(
        selected, before, lambda d, p: d.selects(p.check.name, p.parts, p.by_name())
    )
    if taken is None:
        return []
    named = f"family {family.name!r} declares a known divergence of {divergence.check}"
    named += f" ({_opening(divergence.reason)})"
    earlier = list(dict.fromkeys(_opening(d.reason) for d in taken))
    by = "an earlier one" if len(earlier) == 1 else "earlier ones"
    return [
        f"{named} that marks no test: each of the {len(selected)} it selects (e.g. "
        f"{selected[0].id!r}) is marked first by {by} ({'; '.join(earlier)}); narrow or drop "
        "one of them"
    ]


def _shadowed_key(
    family: Family, key: FirstEditionKey, before: Sequence[FirstEditionKey], ids: Sequence[str]
) -> list[str]:
    """Why the first-edition ``key`` marks none of its tests ``ids``, if keys ``before`` do.

    The first key that matches a test marks it, as :func:`_shadowed` says of divergences.
    """
    marked = [i for i in ids if key.marks(key.check, i)]
    taken = _marked_first(marked, before, lambda k, i: k.marks(key.check, i))
    if taken is None:
        return []
    earlier = ", ".join(dict.fromkeys(repr(k.key) for k in taken))
    return [
        f"family {family.name!r} declares a known divergence {key.key!r} that marks no test: "
        f"each of the {len(marked)} it matches (e.g. {marked[0]!r}) is marked first by "
        f"{earlier}; narrow or drop one of them"
    ]


def _marked_first[E, T](
    tests: Sequence[T], before: Sequence[E], marks: Callable[[E, T], bool]
) -> list[E] | None:
    """The first of ``before`` that ``marks`` each of ``tests``, or ``None`` if any is left.

    ``None`` too when there are no tests: nothing is taken from a divergence that selects none.
    """
    found: list[E] = []
    for test in tests:
        entry = next((e for e in before if marks(e, test)), None)
        if entry is None:
            return None
        found.append(entry)
    return found or None


def _opening(reason: str, words: int = 8) -> str:
    """The first ``words`` words of a divergence's reason, to name it in one line."""
    head = reason.split()
    return " ".join(head[:words]) + (" ..." if len(head) > words else "")


def first_edition_spellings(family: Family, run: Settings) -> list[str]:
    """Each first-edition key of ``family``'s known divergences, in the second spelling.

    A key's fragment becomes the id parts, by name, of the tests it marks: whole parts
    (``layout[fsdp8-remat]``: ``{"mesh": "fsdp8", "variant": "remat"}``) or the parts
    of one name it is inside (``quant_params[ptq]``: ``{"quant": ("ptq_fp8",
    "ptq_int8")}``), when those select exactly the tests the fragment marks.
    """
    registered, lines = checks(), []
    for key in divergences(family.known_divergences)[1]:
        where, fragment = "", key.fragment
        if fragment is not None and key.check in registered:
            every = plan(registered[key.check], family, _wider(run))
            found = _spelling(key.check, fragment, every)
            where = f", {found!r}" if found else f", {{...}}  # name the axes {fragment!r} cuts"
        lines.append(f"{key.key!r} -> Divergence({key.check!r}, reason{where})")
    return lines


def _spelling(check: str, fragment: str, every: Sequence[Planned]) -> dict[str, object] | None:
    """The ``where`` selecting exactly the tests of ``every`` whose id has ``fragment``."""
    marked = [p for p in every if fragment in p.id]
    found: dict[str, set[str]] = {}
    for planned in marked:
        for name, part in _parts(planned, fragment).items():
            found.setdefault(name, set()).add(part)
    where = {n: next(iter(v)) if len(v) == 1 else tuple(sorted(v)) for n, v in found.items()}
    divergence = Divergence(check, "", where)
    selected = [p for p in every if divergence.selects(check, p.parts, p.by_name())]
    return where if where and selected == marked else None


def _parts(planned: Planned, fragment: str) -> dict[str, str]:
    """The consecutive id parts of ``planned`` that spell ``fragment``, or the one holding it."""
    names = [str(name) for name in planned.parts]
    parts = [planned.parts[name] for name in planned.parts]
    for start in range(len(names)):
        for end in range(start + 1, len(names) + 1):
            if "-".join(parts[start:end]) == fragment:
                return dict(zip(names[start:end], parts[start:end], strict=True))
    holding = [i for i, part in enumerate(parts) if fragment in part]
    return {names[holding[0]]: parts[holding[0]]} if len(holding) == 1 else {}
