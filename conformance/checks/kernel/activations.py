"""Activation shardings compared: what the partitioner makes of each paired module call.

Both forwards are compiled once with probes on every module call's inputs and outputs
(:mod:`conformance.runtime.activations`); modules pair as localisation pairs them, and a
module's calls pair in the order each side makes them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from conformance.contract import PathRules
from conformance.runtime.activations import (
    Call,
    Spec,
    Table,
    activation_table,
    render,
    spec_text,
    step_table,
)
from conformance.runtime.case import BATCH_SIZE
from conformance.runtime.diagnose.localise import module_pairs
from conformance.runtime.precision import within
from conformance.runtime.sides import Side

SIDE_NAMES = ("Linen", "NNX")
"""The two sides a difference names by default: the first side's, then the second's."""


def _paired(linen: str, nnx_: str) -> str:
    """``layers_0/attn (NNX layers/0/attn)``: a Linen module and, where it differs, NNX's."""
    module = linen or "(the top module)"
    return module if nnx_ == linen else f"{module} (NNX {nnx_ or 'top module'})"


@dataclasses.dataclass(frozen=True)
class ActivationDifference:
    """One value of a paired module call that the two sides' programs shard differently."""

    linen: Call
    nnx: Call
    occurrence: int
    """Which of the module's calls of this method it is (0: the first)."""
    role: str
    """``"output"`` or ``"input"``."""
    position: int
    """The value's position among the call's array outputs (or inputs)."""
    shape: tuple[int, ...]
    linen_spec: Spec
    nnx_spec: Spec

    def where(self) -> str:
        """``layers_0/attn (NNX layers/0/attn) __call__ output 0``."""
        module = _paired(self.linen.path, self.nnx.path)
        again = f" (call {self.occurrence + 1})" if self.occurrence else ""
        return f"{module} {self.linen.method}{again} {self.role} {self.position}"

    def describe(self, mesh: Mapping[str, int], names: tuple[str, str] = SIDE_NAMES) -> str:
        """The value, then each side's spec with the shards it splits each dimension in."""
        shape = "x".join(map(str, self.shape))
        return (
            f"{self.where()} [{shape}]: {names[0]} {render(self.linen_spec, mesh)}, "
            f"{names[1]} {render(self.nnx_spec, mesh)}"
        )


def layout_rows(
    table: Table, differences: Sequence[Difference]
) -> tuple[tuple[str, str, str], ...]:
    """NNX's ``table`` as report rows: ``(call, its output layouts, Linen's if they differ)``.

    A call's later calls of one method add `` #2``, ... as in :func:`golden_table`.
    """
    apart = {(d.nnx.path, d.linen.method, d.occurrence): d.linen for d in differences}
    rows = []
    for (path, method), calls in table.by_call().items():
        for occurrence, call in enumerate(calls):
            key = f"{path or '(top)'} {method}" + (f" #{occurrence + 1}" if occurrence else "")
            linen = apart.get((path, method, occurrence))
            rows.append((key, _outputs(call), "" if linen is None else _outputs(linen)))
    return tuple(rows)


def _outputs(call: Call) -> str:
    return ", ".join(spec_text(spec) for _, (_, spec) in sorted(call.outputs.items()))


def golden_table(table: Table) -> dict[str, dict[str, list[str]]]:
    """``{"<module> <method>": {"in": [spec, ...], "out": [...]}}`` for every call.

    A call that constrains values directly inside it has ``"constrains"`` too.

    The top module is ``(top)``; a module's later calls of one method add `` #2``, ...
    """
    found: dict[str, dict[str, list[str]]] = {}
    for (path, method), calls in table.by_call().items():
        for occurrence, call in enumerate(calls):
            key = f"{path or '(top)'} {method}" + (f" #{occurrence + 1}" if occurrence else "")
            found[key] = {
                role: [spec_text(spec) for _, (_, spec) in sorted(values.items())]
                for role, values in (("in", call.inputs), ("out", call.outputs))
            }
            if call.constraints:
                found[key]["constrains"] = list(call.constraints)
            if call.relaid:
                found[key]["relaid"] = list(call.relaid)
    return found


@dataclasses.dataclass(frozen=True)
class ConstraintDifference:
    """A paired module whose calls, with its children's, ask for other constraints."""

    linen_module: str
    nnx_module: str
    linen: tuple[str, ...]
    """The constraints only Linen asks for there (``8x32x64 to P(...) = 4x1x1 shards``)."""
    nnx: tuple[str, ...]
    """The constraints only NNX asks for there."""

    def describe(self, names: tuple[str, str] = SIDE_NAMES) -> str:
        """The module, then what one side constrains there and the other not."""
        module = _paired(self.linen_module, self.nnx_module)
        said = [
            f"{name} alone constrains {' and '.join(extra)}"
            for name, extra in zip(names, (self.linen, self.nnx), strict=True)
            if extra
        ]
        return f"{module}: " + "; ".join(said)


def _asked(table: Table, module: str) -> Counter[str]:
    """The constraints every call of ``module`` and of the modules under it asks for."""
    found: Counter[str] = Counter()
    for call in table.calls:
        if within(module, call.path):
            found.update(call.constraints)
    return found


def constraint_differences(
    linen: Table, nnx_: Table, pairs: Mapping[str, str]
) -> list[ConstraintDifference]:
    """The deepest paired modules whose subtrees ask for other sharding constraints.

    A difference counts at a module when its subtree's constraints differ and so do those
    of every paired module enclosing it: a rewrite that moves a constraint from a module
    into the module that encloses it compares equal there. It is reported at the deepest
    such module, in path order.
    """
    pairs = {"": "", **pairs}
    mine = {module: _asked(linen, module) for module in pairs}
    theirs = {module: _asked(nnx_, target) for module, target in pairs.items()}
    differs = {module for module in pairs if mine[module] != theirs[module]}
    kept = {m for m in differs if all(p in differs for p in pairs if p != m and within(p, m))}
    deepest = sorted(m for m in kept if not any(o != m and within(m, o) for o in kept))
    return [
        ConstraintDifference(
            m,
            pairs[m],
            tuple(sorted((mine[m] - theirs[m]).elements())),
            tuple(sorted((theirs[m] - mine[m]).elements())),
        )
        for m in deepest
    ]


@dataclasses.dataclass(frozen=True)
class RelaidDifference:
    """A paired call whose values a rematerialised step recomputes in other layouts."""

    linen: Call
    nnx: Call
    occurrence: int

    def describe(self, mesh: Mapping[str, int], names: tuple[str, str] = SIDE_NAMES) -> str:
        """The call, then the other layouts each side's recomputation gives its values."""
        del mesh
        module = self.linen.path or "(the top module)"
        said = [
            f"{name} recomputes {'; '.join(call.relaid) or 'nothing in another layout'}"
            for name, call in zip(names, (self.linen, self.nnx), strict=True)
        ]
        return f"{module} {self.linen.method}: " + ", ".join(said)


def _differences(
    linen: Call, nnx_: Call, occurrence: int
) -> list[ActivationDifference | RelaidDifference]:
    found = []
    for role, mine, theirs in (
        ("output", linen.outputs, nnx_.outputs),
        ("input", linen.inputs, nnx_.inputs),
    ):
        for position in sorted(mine.keys() & theirs.keys()):
            (shape, a), (other, b) = mine[position], theirs[position]
            if shape == other and a != b:
                found.append(
                    ActivationDifference(linen, nnx_, occurrence, role, position, shape, a, b)
                )
    if linen.relaid != nnx_.relaid:
        found.append(RelaidDifference(linen, nnx_, occurrence))
    return found


Difference = ActivationDifference | RelaidDifference
"""A value of a paired call laid out differently, or recomputed in other layouts."""


def compare_tables(linen: Table, nnx_: Table, pairs: Mapping[str, str]) -> list[Difference]:
    """Every value of a paired call the two programs shard differently, in Linen's order.

    ``pairs`` maps Linen module paths to NNX ones (the top modules always pair). A
    module's calls of one method pair in order; a value whose shapes differ is left to
    the structure and numeric checks.
    """
    pairs = {"": "", **pairs}
    theirs = nnx_.by_call()
    seen: dict[tuple[str, str], int] = {}
    found = []
    for call in linen.calls:
        occurrence = seen.get((call.path, call.method), 0)
        seen[(call.path, call.method)] = occurrence + 1
        target = pairs.get(call.path)
        counterpart = theirs.get((target, call.method), []) if target is not None else []
        if occurrence < len(counterpart):
            found += _differences(call, counterpart[occurrence], occurrence)
    return found


def unanswered(linen: Table, nnx_: Table, names: tuple[str, str] = SIDE_NAMES) -> list[str]:
    """Each side whose compile answered none of its probes, in words; ``[]`` if both did.

    Such a table compares equal to anything: its executable did not come from a compile
    that partitioned it (a persistent compilation cache reads executables back).
    """
    return [
        f"{name}: the partitioner answered none of the probes of its {table.traced} module "
        "call(s), so nothing of it was compared (was its executable read back from a "
        "persistent compilation cache instead of compiled?)"
        for name, table in zip(names, (linen, nnx_), strict=True)
        if table.traced and not table.calls
    ]


@dataclasses.dataclass(frozen=True)
class Program:
    """A program whose activations are compared, and how a side's table of it is made."""

    name: str
    table: Callable[[Side, int], Table]
    constraints: bool
    """Whether the constraints each side asks for are compared too: in a forward they are
    the model's own; a train step adds those each backend's autodiff transposes (NNX's
    scan constrains cotangents Linen's does not), so only its layouts are compared."""


PROGRAMS = (
    Program("forward", activation_table, constraints=True),
    Program("train_step", step_table, constraints=False),
)
"""The programs ``activation_sharding`` compares, in report order."""


def activation_differences(
    linen: Side, nnx_: Side, rules: PathRules, program: Program, rows: int = BATCH_SIZE
) -> tuple[list[Difference], list[ConstraintDifference], Table, Table]:
    """Where the two sides' ``program`` lays out or constrains values.

    The values of :func:`compare_tables`, the modules of :func:`constraint_differences`
    (none when a side lays values out itself, on explicit axes: it relays them where its
    code says rather than asking the compiler). Returns them with both sides' tables, of a
    batch of ``rows``. ``rules`` are the first side's path rules, which pair modules
    holding no parameters.
    """
    first, second = program.table(linen, rows), program.table(nnx_, rows)
    pairs = module_pairs(
        linen.leaf_map().pairs(),
        rules,
        sorted({call.path for call in first.calls}),
        sorted({call.path for call in second.calls}),
    )
    constrained = program.constraints and not (linen.lays_out_itself or nnx_.lays_out_itself)
    asked = constraint_differences(first, second, pairs) if constrained else []
    return compare_tables(first, second, pairs), asked, first, second
