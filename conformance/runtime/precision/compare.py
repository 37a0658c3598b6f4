"""Two precision profiles compared: the modules that compute in other dtypes per side.

Profiles (:mod:`~conformance.runtime.precision.profile`) are compared module by module
through the same pairing localisation uses, group by group: each primitive, the sums of
products, and rounding. A group both sides compute in different sets of dtypes is a
precision change, and so is one side rounding where the other does not; another
operation only one side computes is a change of formula (``sqrt`` and a division for
``rsqrt``), left to the numeric checks. An operation counts for its module's subtree,
and a difference found there must also show along the chain of modules from each
enclosing paired module down to it: a rewrite that moves a softmax from an attention
module into its block compares equal at the block, while other modules' operations
cannot hide a change. It is reported at the deepest module where it shows. The dtypes a
method's calls take and return are compared strictly, module by module.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from conformance.contract import PrecisionChange
from conformance.runtime.precision.profile import ROUNDING, Op, Profile, within


@dataclasses.dataclass(frozen=True)
class GroupRow:
    """Operations of one group that compute in dtypes only one side computes them in."""

    group: str
    linen: frozenset[Op]
    nnx: frozenset[Op]

    @property
    def names(self) -> frozenset[str]:
        """What an accepted change names to cover it: the group or a primitive in it."""
        return frozenset({self.group, *(op for _, _, op in self.linen | self.nnx)})

    def describe(self, names: tuple[str, str] = ("Linen", "NNX")) -> str:
        """``NNX computes exp in float32, Linen exp in bfloat16``, the sides by ``names``."""
        first, second = names
        if self.group == ROUNDING:
            sides = ((second, self.nnx), (first, self.linen))
            said = [f"{side} rounds {_casts(ops)}" for side, ops in sides if ops]
            said += [f"{side} does not round there" for side, ops in sides if not ops]
            return ", ".join(said)
        nnx_, linen = _computes(self.nnx), _computes(self.linen)
        if nnx_ and linen:
            return f"{second} computes {nnx_}, {first} {linen}"
        one, other = (second, first) if nnx_ else (first, second)
        return f"{one} computes {nnx_ or linen}; {other} computes no {self.group} in those dtypes"


def _casts(ops: frozenset[Op]) -> str:
    return " and ".join(sorted({dtypes for _, dtypes, _ in ops}))


def _computes(ops: frozenset[Op]) -> str:
    by_dtypes: dict[str, list[str]] = {}
    for _, dtypes, name in sorted(ops, key=lambda op: (op[1], op[2])):
        by_dtypes.setdefault(dtypes, []).append(name)
    return "; ".join(f"{' and '.join(names)} in {dtypes}" for dtypes, names in by_dtypes.items())


@dataclasses.dataclass(frozen=True)
class BoundaryRow:
    """A method whose calls take or return other floating-point dtypes on each side."""

    what: str
    """``"<method> takes"`` or ``"<method> returns"``."""
    linen: frozenset[str]
    nnx: frozenset[str]

    @property
    def names(self) -> frozenset[str]:
        """What an accepted change names to cover it: :attr:`what`."""
        return frozenset({self.what})

    def describe(self, names: tuple[str, str] = ("Linen", "NNX")) -> str:
        """``NNX's __call__ returns float32, Linen's bfloat16``, the sides by ``names``."""
        first, second = names
        return f"{second}'s {self.what} {_dtypes(self.nnx)}, {first}'s {_dtypes(self.linen)}"


def _dtypes(found: frozenset[str]) -> str:
    return " and ".join(sorted(found)) if found else "no floating-point value"


Row = GroupRow | BoundaryRow
"""A row of a :class:`PrecisionDifference`: operations, or a method's boundary."""


@dataclasses.dataclass(frozen=True)
class PrecisionDifference:
    """What one paired module computes, takes or returns in other dtypes on each side."""

    linen_module: str
    nnx_module: str
    rows: tuple[Row, ...]

    def describe(self, names: tuple[str, str] = ("Linen", "NNX")) -> str:
        """One line: the module, then which side (by ``names``) computes what in which dtype."""
        where = self.linen_module or "(the top module)"
        if self.nnx_module != self.linen_module:
            where += f" ({names[1]} {self.nnx_module or 'top module'})"
        return f"{where}: " + "; ".join(row.describe(names) for row in self.rows)


def _group_rows(first: frozenset[Op], second: frozenset[Op]) -> dict[str, GroupRow]:
    """Per group both compute (and rounding), the operations in dtypes the other never uses."""
    rows = {}
    groups = {op[0] for op in first} & {op[0] for op in second}
    for group in sorted(groups | ({op[0] for op in first | second} & {ROUNDING})):
        a = {dtypes for g, dtypes, _ in first if g == group}
        b = {dtypes for g, dtypes, _ in second if g == group}
        if a != b:
            only_a = frozenset(op for op in first if op[0] == group and op[1] not in b)
            only_b = frozenset(op for op in second if op[0] == group and op[1] not in a)
            rows[group] = GroupRow(group, only_a, only_b)
    return rows


def compare_profiles(
    linen: Profile, nnx_: Profile, pairs: Mapping[str, str]
) -> list[PrecisionDifference]:
    """Every precision difference between paired modules, deepest first, in path order.

    ``pairs`` maps Linen module paths to NNX ones; the top modules (``""``) always pair.
    A group of operations (a primitive, :data:`SUM_OF_PRODUCTS` or :data:`ROUNDING`)
    differs at a module when, over its subtree, the sides compute it in different sets of
    dtypes, both computing it unless it is rounding. It is reported at the deepest
    module where it differs, and along the chain from every enclosing paired module down
    to it (:meth:`Profile.chain`). A call's boundary dtypes are compared for each method
    both sides call.
    """
    pairs = {"": "", **pairs}
    rows = {m: _group_rows(linen.subtree(m), nnx_.subtree(t)) for m, t in pairs.items()}

    def held(module: str) -> set[str]:
        groups = set(rows[module])
        for top in pairs:
            if groups and top != module and within(top, module):
                chain = linen.chain(top, module), nnx_.chain(pairs[top], pairs[module])
                groups &= set(_group_rows(*chain))
        return groups

    kept = {module: held(module) for module in pairs}
    found = []
    for module in sorted(pairs, key=lambda m: (-m.count("/") if m else 1, m)):
        groups = kept[module].difference(
            *(kept[other] for other in pairs if other != module and within(module, other))
        )
        here = tuple(rows[module][group] for group in sorted(groups))
        here += _boundary(linen, nnx_, module, pairs[module])
        if here:
            found.append(PrecisionDifference(module, pairs[module], here))
    return found


def _boundary(linen: Profile, nnx_: Profile, module: str, target: str) -> tuple[BoundaryRow, ...]:
    """The methods of a paired module whose calls take or return other dtypes."""
    rows = []
    for (path, method), dtypes in sorted(linen.boundary.items()):
        other = nnx_.boundary.get((target, method))
        if path != module or other is None:
            continue
        for word, what in (("in", "takes"), ("out", "returns")):
            a = frozenset(d.split()[1] for d in dtypes if d.startswith(word + " "))
            b = frozenset(d.split()[1] for d in other if d.startswith(word + " "))
            if a != b:
                rows.append(BoundaryRow(f"{method} {what}", a, b))
    return tuple(rows)


def unmatched(
    differences: Sequence[PrecisionDifference], accepted: Sequence[PrecisionChange]
) -> tuple[list[PrecisionDifference], list[PrecisionChange]]:
    """``differences`` no accepted change covers, and accepted changes that cover none.

    A change covers a row of a difference whose Linen or NNX module path its ``module``
    matches in full and that its ``ops`` name: a group (``"rounding"``,
    ``"sum of products"``), a primitive in it, or ``"<method> takes"`` /
    ``"<method> returns"``.
    """
    used: set[int] = set()
    found = []
    for difference in differences:
        paths = (difference.linen_module, difference.nnx_module)
        kept = []
        for row in difference.rows:
            covering = {
                i
                for i, change in enumerate(accepted)
                if row.names & set(change.ops)
                and any(re.fullmatch(change.module, p) for p in paths)
            }
            used |= covering
            if not covering:
                kept.append(row)
        if kept:
            found.append(dataclasses.replace(difference, rows=tuple(kept)))
    return found, [change for i, change in enumerate(accepted) if i not in used]
