"""Which precision each module computes in: a forward's precision profile, per side.

Each side's forward is traced once (never compiled or run) with every module method call
in a name scope of its own (:mod:`conformance.runtime.calls`). The traced program's
operations, inside ``scan``, ``remat`` and ``jit`` bodies too, are then sorted to the
innermost module call around them, and the profile keeps, per module, the dtypes of:

* sums of products (``dot_general``, ``reduce_sum``, ...): the dtypes their operands
  were computed in (before a widening cast, which is exact) and the dtype they
  accumulate in, so a ``dot_general`` and a sum of a product compare equal in equal
  dtypes;
* rounding: casts to a narrower floating-point dtype;
* transcendental operations (``exp``, ``log``, ``logistic``, ``tanh``, ``rsqrt``, ...);
* extrema (``reduce_max``, ``argmax``, ...);
* its calls' floating-point inputs and outputs (the casts at its boundary).

Two profiles are compared module by module through the same pairing localisation uses,
primitive by primitive (sums of products as one). One both sides compute in different
sets of dtypes is a precision change, and so is one side rounding where the other does
not; another operation only one side computes is a change of formula (``sqrt`` and a
division for ``rsqrt``), left to the numeric checks. An operation counts
for a module's whole subtree, so a rewrite that moves a softmax from a block into its
attention module compares equal at the block; a difference is reported at the deepest
module where it shows, and only if it shows at every enclosing paired module up to the
top one.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from conformance.contract import Batch
from conformance.runtime.backends import Runner
from conformance.runtime.calls import ModuleCall

SUM_OF_PRODUCTS = "sum of products"
"""The group of ``dot_general`` and sums, by the dtypes their operands were computed in
and the dtype they accumulate in (``bfloat16 -> float32``): a ``dot_general`` and a sum
of a product compare equal in equal dtypes, and an operand widened by a cast counts in
the dtype it was cast from (widening is exact)."""

ROUNDING = "rounding"
"""The group of casts to a narrower floating-point dtype (``float32 -> bfloat16``): where
precision is lost. One side rounding where the other never does is a precision change."""

_ACCUMULATIONS = ("dot_general", "reduce_sum", "reduce_prod", "cumsum", "cumlogsumexp")

PRIMITIVES = frozenset(
    {*_ACCUMULATIONS, "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "rsqrt"}
    | {"sqrt", "erf", "sin", "cos", "pow", "reduce_max", "reduce_min", "argmax", "argmin"}
    | {"cummax", "cummin"}
)
"""The primitives a profile names: sums of products, transcendentals and extrema."""

_SCOPE = "conformance_call_"
_SCOPE_RE = re.compile(_SCOPE + r"(\d+)")

Op = tuple[str, str, str]
"""``(group, dtypes, primitive)``: ``("exp", "float32", "exp")``, or
``(SUM_OF_PRODUCTS, "bfloat16 -> float32", "dot_general")``: operations of one group
compare together."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """One side's precision profile of a forward."""

    ops: Mapping[str, frozenset[Op]]
    """Module path -> the operations traced directly inside its calls (not a child's)."""
    boundary: Mapping[tuple[str, str], frozenset[str]]
    """``(module path, method)`` -> its calls' input and output dtypes (``in bfloat16``)."""

    def subtree(self, module: str) -> frozenset[Op]:
        """The operations of ``module`` and every module under it."""
        return frozenset().union(*(ops for path, ops in self.ops.items() if _under(module, path)))


def _under(prefix: str, path: str) -> bool:
    return prefix in ("", path) or path.startswith(prefix + "/")


def _floating(tree: Any) -> set[str]:
    return {
        str(leaf.dtype)
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    }


class _Scopes:
    """Opens a name scope per module call and notes its boundary dtypes."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.boundary: dict[tuple[str, str], set[str]] = collections.defaultdict(set)

    def around(self, call: ModuleCall, run: Callable[[], Any]) -> Any:
        """Run ``call`` inside a name scope that identifies it in the traced program."""
        scope = f"{_SCOPE}{len(self.paths)}"
        self.paths.append(call.path)
        with jax.named_scope(scope):
            output = run()
        seen = self.boundary[(call.path, call.method)]
        seen |= {f"in {dtype}" for dtype in _floating(call.args)}
        seen |= {f"out {dtype}" for dtype in _floating(output)}
        return output

    def profile(self, program: jcore.ClosedJaxpr) -> Profile:
        found: dict[str, set[Op]] = collections.defaultdict(set)
        for stack, eqn, widened in _equations(program.jaxpr, "", {}):
            calls = _SCOPE_RE.findall(stack)
            op = _op(eqn, widened)
            if calls and op is not None:
                found[self.paths[int(calls[-1])]].add(op)
        ops = {path: frozenset(found_ops) for path, found_ops in found.items()}
        boundary = {key: frozenset(dtypes) for key, dtypes in self.boundary.items()}
        return Profile(ops, boundary)


def _inner(params: Mapping[str, Any]) -> Iterator[jcore.Jaxpr]:
    """The jaxprs an equation's parameters hold (``scan``, ``cond``, ``remat``, ``jit`` bodies)."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item


Widened = dict[jcore.Var, str]
"""Variables made by casting to a wider floating-point dtype -> the dtype cast from."""


def _equations(
    jaxpr: jcore.Jaxpr, stack: str, widened: Widened
) -> Iterator[tuple[str, jcore.JaxprEqn, Widened]]:
    """Every equation of ``jaxpr`` and of the jaxprs inside it, with its full name stack.

    An inner jaxpr's name stacks are relative to the equation that holds it. Each comes
    with the variables widened so far (:data:`Widened`); an inner jaxpr taking its
    equation's operands one to one (``jit``, ``scan``, ``remat`` bodies) inherits theirs.
    """
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        yield here, eqn, widened
        if _narrower(eqn) is False:
            widened[eqn.outvars[0]] = _computed_in(eqn.invars[0], widened)
        for inner in _inner(eqn.params):
            passed: Widened = {}
            if len(inner.invars) == len(eqn.invars):
                passed = {
                    mine: widened[theirs]
                    for mine, theirs in zip(inner.invars, eqn.invars, strict=True)
                    if isinstance(theirs, jcore.Var) and theirs in widened
                }
            yield from _equations(inner, here, passed)


def _computed_in(var: Any, widened: Widened) -> str:
    """The dtype ``var``'s value was computed in: before any cast that widened it (exact)."""
    if isinstance(var, jcore.Var) and var in widened:
        return widened[var]
    return str(var.aval.dtype)


def _narrower(eqn: jcore.JaxprEqn) -> bool | None:
    """For a cast between floating-point dtypes: whether to a narrower one; else ``None``."""
    if eqn.primitive.name != "convert_element_type":
        return None
    source, target = (jnp.dtype(v.aval.dtype) for v in (eqn.invars[0], eqn.outvars[0]))
    if not all(jnp.issubdtype(d, jnp.floating) for d in (source, target)):
        return None
    if source.itemsize == target.itemsize:
        return None
    return target.itemsize < source.itemsize


def _op(eqn: jcore.JaxprEqn, widened: Widened) -> Op | None:
    """What ``eqn`` computes in, if the profile names it (see :data:`SUM_OF_PRODUCTS`)."""
    name = eqn.primitive.name
    if _narrower(eqn):
        return ROUNDING, f"{eqn.invars[0].aval.dtype} -> {eqn.outvars[0].aval.dtype}", name
    if name not in PRIMITIVES:
        return None
    if name in _ACCUMULATIONS:
        operands = sorted(
            {
                _computed_in(v, widened)
                for v in eqn.invars
                if jnp.issubdtype(v.aval.dtype, jnp.inexact)
            }
        )
        return SUM_OF_PRODUCTS, f"{' x '.join(operands)} -> {eqn.outvars[0].aval.dtype}", name
    return name, str(eqn.invars[0].aval.dtype), name


def profile(runner: Runner, params: Any, batch: Batch) -> Profile:
    """``runner``'s forward's precision profile; ``params`` may be ``ShapeDtypeStruct`` leaves."""
    scopes = _Scopes()
    context = runner.context(abstract=True)
    program = jax.make_jaxpr(runner.intercepted(scopes.around))(runner.pack(params), context, batch)
    return scopes.profile(program)


@dataclasses.dataclass(frozen=True)
class GroupRow:
    """Operations of one group that compute in dtypes only one side computes them in."""

    group: str
    linen: frozenset[Op]
    nnx: frozenset[Op]

    @property
    def names(self) -> frozenset[str]:
        """The primitives named on either side."""
        return frozenset(op for _, _, op in self.linen | self.nnx)

    def describe(self) -> str:
        """``NNX computes exp in float32, Linen exp in bfloat16``."""
        if self.group == ROUNDING:
            sides = (("NNX", self.nnx), ("Linen", self.linen))
            said = [
                f"{side} rounds {_computes(ops).split(' in ')[-1]}" for side, ops in sides if ops
            ]
            said += [f"{side} does not round there" for side, ops in sides if not ops]
            return ", ".join(said)
        nnx_, linen = _computes(self.nnx), _computes(self.linen)
        if nnx_ and linen:
            return f"NNX computes {nnx_}, Linen {linen}"
        one, other = ("NNX", "Linen") if nnx_ else ("Linen", "NNX")
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

    def describe(self) -> str:
        """``NNX's __call__ returns float32, Linen's bfloat16``."""
        return f"NNX's {self.what} {_dtypes(self.nnx)}, Linen's {_dtypes(self.linen)}"


def _dtypes(found: frozenset[str]) -> str:
    return " and ".join(sorted(found)) if found else "no floating-point value"


Row = GroupRow | BoundaryRow


@dataclasses.dataclass(frozen=True)
class PrecisionDifference:
    """What one paired module computes, takes or returns in other dtypes on each side."""

    linen_module: str
    nnx_module: str
    rows: tuple[Row, ...]

    def describe(self) -> str:
        """One line: the module, then in words which side computes what in which dtype."""
        where = self.linen_module or "(the top module)"
        if self.nnx_module != self.linen_module:
            where += f" (NNX {self.nnx_module or 'top module'})"
        return f"{where}: " + "; ".join(row.describe() for row in self.rows)


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
    differs at a module when, over the module's subtree, the sides compute it in
    different sets of dtypes, both computing it unless it is rounding (one side alone
    computing another operation is a change of formula, not of precision). It
    is reported at the deepest module where it differs at every enclosing paired module
    too. A call's boundary dtypes are compared
    for each method both sides call.
    """
    pairs = {"": "", **pairs}
    rows = {m: _group_rows(linen.subtree(m), nnx_.subtree(t)) for m, t in pairs.items()}
    held = {
        module: set.intersection(*(set(rows[other]) for other in pairs if _under(other, module)))
        for module in pairs
    }
    found = []
    for module in sorted(pairs, key=lambda m: (-m.count("/") if m else 1, m)):
        groups = held[module].difference(
            *(held[other] for other in pairs if other != module and _under(module, other))
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
    differences: Sequence[PrecisionDifference], accepted: Sequence[Any]
) -> tuple[list[PrecisionDifference], list[Any]]:
    """``differences`` no accepted change covers, and accepted changes that cover none.

    An accepted change has ``module`` (a regular expression matched in full against the
    Linen or the NNX module path) and ``ops``: it covers a row naming any of them (a
    primitive computed in other dtypes, or ``"<method> takes"`` / ``"<method> returns"``).
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
