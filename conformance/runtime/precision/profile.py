"""A forward's precision profile: which dtypes each module computes in, on one side.

Each side's forward is traced once (never compiled or run) with every module method call
in a name scope of its own (:mod:`conformance.runtime.calls`). The traced program's
operations, inside ``scan``, ``remat`` and ``jit`` bodies too, are then sorted to the
innermost module call around them, and the profile keeps, per module, the dtypes of:

* sums of products (``dot_general``, ``reduce_sum``, ...): the dtypes their operands
  were computed in (before a widening cast, which is exact, and through reshapes and
  other moves of data) and the dtype they accumulate in, so a ``dot_general`` and a sum
  of a product compare equal in equal dtypes;
* rounding: casts to a floating-point dtype with fewer mantissa bits or a smaller range
  than the value was computed in;
* transcendental operations (``exp``, ``log``, ``logistic``, ``tanh``, ``rsqrt``, ...);
* extrema (``reduce_max``, ``argmax``, ...);
* its calls' floating-point inputs and outputs (the casts at its boundary).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from conformance.contract import Batch
from conformance.runtime.backends import Runner
from conformance.runtime.calls import ModuleCall
from conformance.runtime.traced import inner_jaxprs

SUM_OF_PRODUCTS = "sum of products"
"""The group of ``dot_general`` and sums, by the dtypes their operands were computed in
and the dtype they accumulate in (``bfloat16 -> float32``): a ``dot_general`` and a sum
of a product compare equal in equal dtypes, and an operand widened by a cast counts in
the dtype it was cast from (widening is exact)."""

ROUNDING = "rounding"
"""The group of casts that lose precision or range (``float32 -> bfloat16``). One side
rounding where the other never does is a precision change."""

_ACCUMULATIONS = ("dot_general", "reduce_sum", "reduce_prod", "cumsum", "cumlogsumexp")

PRIMITIVES = frozenset(
    {*_ACCUMULATIONS, "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "rsqrt"}
    | {"sqrt", "erf", "sin", "cos", "pow", "reduce_max", "reduce_min", "argmax", "argmin"}
    | {"cummax", "cummin"}
)
"""The primitives a profile names: sums of products, transcendentals and extrema."""

_MOVES = frozenset(
    {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice"}
    | {"dynamic_slice", "concatenate", "copy", "copy_p", "sharding_constraint", "rev"}
)
"""Primitives that move values without computing: a widened value stays widened."""

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
        return frozenset().union(*(ops for path, ops in self.ops.items() if within(module, path)))

    def chain(self, top: str, bottom: str) -> frozenset[Op]:
        """The operations of ``bottom``'s subtree and of each module from ``top`` down to it.

        Not those of ``top``'s other children: what ``bottom`` computes, wherever between
        the two a rewrite may have moved it.
        """
        between = (
            ops for path, ops in self.ops.items() if within(top, path) and within(path, bottom)
        )
        return self.subtree(bottom).union(*between)


def within(prefix: str, path: str) -> bool:
    """Whether module ``path`` is ``prefix`` or inside it (every module is inside ``""``)."""
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
        """The profile of ``program``, traced with :meth:`around` on its module calls.

        An operation in no scope this trace opened (one JAX reused from an earlier trace)
        belongs to no module.
        """
        found: dict[str, set[Op]] = collections.defaultdict(set)
        for stack, eqn, widened in _equations(program.jaxpr, "", {}):
            calls = [int(i) for i in _SCOPE_RE.findall(stack) if int(i) < len(self.paths)]
            op = _op(eqn, widened)
            if calls and op is not None:
                found[self.paths[calls[-1]]].add(op)
        ops = {path: frozenset(found_ops) for path, found_ops in found.items()}
        boundary = {key: frozenset(dtypes) for key, dtypes in self.boundary.items()}
        return Profile(ops, boundary)


def _inner(eqn: jcore.JaxprEqn) -> Iterator[tuple[jcore.Jaxpr, tuple[Any, ...]]]:
    """The jaxprs ``eqn``'s parameters hold, each with the operands it takes one to one.

    ``jit`` and ``remat`` bodies take the equation's operands; a ``scan`` body its
    constants and scanned inputs, not its carry (from the second iteration on, the body's
    own output); any other (``cond`` branches, ``while`` bodies) none of them.
    """
    for inner in inner_jaxprs(eqn):
        operands: tuple[Any, ...] = ()
        if len(inner.invars) == len(eqn.invars):
            operands = tuple(eqn.invars)
        if eqn.primitive.name == "scan":
            consts, carry = _scan_counts(eqn.params)
            operands = (*operands[:consts], *([None] * carry), *operands[consts + carry :])
        yield inner, operands


def _scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """A ``scan``'s numbers of constant and carried operands, before its scanned inputs.

    jax 0.12 keeps them as the flat trees ``ft_in`` (constants, carry, inputs); earlier
    releases as ``num_consts`` and ``num_carry``.
    """
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


Widened = dict[jcore.Var, str]
"""Variables holding a value widened by a cast -> the dtype it was computed in."""


def _equations(
    jaxpr: jcore.Jaxpr, stack: str, widened: Widened
) -> Iterator[tuple[str, jcore.JaxprEqn, Widened]]:
    """Every equation of ``jaxpr`` and of the jaxprs inside it, with its full name stack.

    An inner jaxpr's name stacks are relative to the equation that holds it. Each comes
    with the variables widened so far (:data:`Widened`), followed through casts and moves
    of data (:data:`_MOVES`); an inner jaxpr inherits its operands' (:func:`_inner`).
    """
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        yield here, eqn, widened
        _widen(eqn, widened)
        for inner, operands in _inner(eqn):
            passed = {
                mine: widened[theirs]
                for mine, theirs in zip(inner.invars, operands, strict=False)
                if isinstance(theirs, jcore.Var) and theirs in widened
            }
            yield from _equations(inner, here, passed)


def _widen(eqn: jcore.JaxprEqn, widened: Widened) -> None:
    """Note ``eqn``'s output in ``widened`` if it holds a value computed in a narrower dtype."""
    name = eqn.primitive.name
    if name != "convert_element_type" and name not in _MOVES:
        return
    inputs = [v for v in eqn.invars if _is_float(v.aval.dtype)]
    out = eqn.outvars[0]
    if not inputs or not _is_float(out.aval.dtype):
        return
    computed = max((jnp.dtype(_computed_in(v, widened)) for v in inputs), key=_bits)
    if computed != jnp.dtype(out.aval.dtype) and _covers(out.aval.dtype, computed):
        widened[out] = str(computed)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _bits(dtype: Any) -> tuple[int, float]:
    info = jnp.finfo(dtype)
    return int(info.nmant), float(info.max)


def _covers(wide: Any, narrow: Any) -> bool:
    """Whether every value of dtype ``narrow`` is exact in dtype ``wide``."""
    (wide_mant, wide_max), (narrow_mant, narrow_max) = _bits(wide), _bits(narrow)
    return wide_mant >= narrow_mant and wide_max >= narrow_max


def _computed_in(var: Any, widened: Widened) -> str:
    """The dtype ``var``'s value was computed in: before any cast that widened it (exact)."""
    if isinstance(var, jcore.Var) and var in widened:
        return widened[var]
    return str(var.aval.dtype)


def _op(eqn: jcore.JaxprEqn, widened: Widened) -> Op | None:
    """What ``eqn`` computes in, if the profile names it (see :data:`SUM_OF_PRODUCTS`)."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        source, target = _computed_in(eqn.invars[0], widened), eqn.outvars[0].aval.dtype
        if _is_float(source) and _is_float(target) and not _covers(target, source):
            return ROUNDING, f"{source} -> {target}", name
        return None
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


def profile(runner: Runner, batch: Batch) -> Profile:
    """``runner``'s forward's precision profile, traced from abstract parameters and batch."""
    scopes = _Scopes()
    params = {path: jax.ShapeDtypeStruct(s.shape, s.dtype) for path, s in runner.specs.items()}
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    forward = runner.intercepted(scopes.around)
    program = jax.make_jaxpr(forward)(runner.pack(params), runner.context(abstract=True), batch)
    return scopes.profile(program)
