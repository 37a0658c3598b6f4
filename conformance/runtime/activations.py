"""Activation shardings: what the partitioner makes of each module call's values, per side.

Each side's forward (:func:`activation_table`) or train step (:func:`step_table`) is
traced with every module method call routed through :mod:`conformance.runtime.calls`:
the call's array inputs and outputs pass through a *probe*, an identity whose lowering
is ``jax.debug.inspect_array_sharding``'s. When the program is compiled for the side's
mesh, XLA's partitioner reports the sharding it chose for each probed value, after
propagation, exactly as it does for that function; nothing runs, and the mesh may be a
TPU slice this host only compiles for.

The probe is a pure identity where ``inspect_array_sharding`` is an effect: a body that a
transform traces only to drop it (Linen's ``nn.scan`` traces its body once to find what
it broadcasts, and refuses an effect there) drops the probe with it. The custom call it
lowers to returns nothing and the value goes on unchanged, so the program is partitioned
as it is without probes.

Beside what the compiler chose, the table keeps what each call *asks* for: the sharding
constraints traced directly inside it (not in a child call), each call running in a name
scope of its own. The compiler may lay a value out alike whether or not a side
constrains it, on one mesh and size; not on every one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.sharding_impls import parse_flatten_op_sharding
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh, PartitionSpec

from conformance.core.cost import collectives
from conformance.core.scope import kept
from conformance.core.sharding import spec_to_json
from conformance.runtime.aot import abstract_batch, abstract_params, workload_trainer
from conformance.runtime.calls import ModuleCall
from conformance.runtime.case import BATCH_SIZE
from conformance.runtime.live import Side
from conformance.runtime.traced import scoped_equations

Spec = tuple[Any, ...]
"""One value's sharding: per dimension ``None``, a mesh axis, or a tuple of mesh axes."""

_probe_p = jcore.Primitive("conformance_sharding_probe")

_SCOPE = "conformance_activation_"
_SCOPE_RE = re.compile(_SCOPE + r"(\d+)")


def _probe_lowering(ctx: mlir.LoweringRuleContext, value: Any, *, callback: Any) -> list[Any]:
    """The value, and beside it the custom call ``inspect_array_sharding`` lowers to.

    XLA's SPMD partitioner answers that call with the operand's ``HloSharding``
    (jax/_src/debugging.py, ``_inspect_sharding_lowering_rule``); unlike jax's rule, this
    one needs no mesh of its own: ``callback`` reads the sharding on the case's mesh,
    whatever meshes the model's own constraints name.
    """
    ctx.module_context.add_keepalive(callback)
    hlo.CustomCallOp(
        [value.type],
        [value],
        call_target_name=ir.StringAttr.get("InspectSharding"),
        has_side_effect=ir.BoolAttr.get(True),
        api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]),
        backend_config=ir.StringAttr.get(xc.encode_inspect_sharding_callback(callback)),
        operand_layouts=None,
        result_layouts=None,
    )
    return [value]


_probe_p.def_impl(lambda value, *, callback: value)
_probe_p.def_abstract_eval(lambda aval, *, callback: aval)
mlir.register_lowering(_probe_p, _probe_lowering)
ad.primitive_jvps[_probe_p] = lambda primals, tangents, **params: (
    _probe_p.bind(*primals, **params),
    tangents[0],
)
batching.primitive_batchers[_probe_p] = lambda args, dims, **params: (
    _probe_p.bind(*args, **params),
    dims[0],
)


def spec_text(spec: Spec) -> str:
    """``P(('data', 'fsdp'), None, 'tensor')``: one entry per dimension."""
    return f"P({', '.join(repr(entry) for entry in spec)})"


def render(spec: Spec, mesh: Mapping[str, int]) -> str:
    """:func:`spec_text` with the shards it splits each dimension in (``= 4x1x2 shards``)."""
    shards = [math.prod(mesh[a] for a in _axes(entry)) for entry in spec]
    return f"{spec_text(spec)} = {'x'.join(map(str, shards))} shards"


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Call:
    """One module method call's array inputs and outputs, each with its sharding."""

    path: str
    """The module's path in the side's own paths (``""``: the top module)."""
    method: str
    inputs: Mapping[int, tuple[tuple[int, ...], Spec]]
    """Array argument (flattened, in order) -> its shape and sharding."""
    outputs: Mapping[int, tuple[tuple[int, ...], Spec]]
    """Array output (flattened, in order) -> its shape and sharding."""
    constraints: tuple[str, ...] = ()
    """The sharding constraints traced directly inside it, sorted: ``8x32x64 to P(...)``
    (rendered on the constraint's own mesh, which may name other axes)."""
    relaid: tuple[str, ...] = ()
    """Values a rematerialised train step recomputes in another layout than its forward
    gave them: ``output 0 also P(...)``."""


@dataclasses.dataclass(frozen=True)
class Table:
    """Every probed module call of one side's forward, in the order they were traced."""

    calls: tuple[Call, ...]
    """In the order they returned: a module's children before it."""
    mesh: Mapping[str, int]
    """The mesh's axis sizes, by name."""
    collectives: Mapping[str, tuple[int, int]]
    """The compiled forward's collectives: ``{kind: (count, bytes produced)}``."""
    traced: int = 0
    """Module calls traced with probes, answered or not (a dropped trace's never are)."""

    def by_call(self) -> dict[tuple[str, str], list[Call]]:
        """``(path, method)`` -> its calls in order (a module called twice has two)."""
        found: dict[tuple[str, str], list[Call]] = collections.defaultdict(list)
        for call in self.calls:
            found[(call.path, call.method)].append(call)
        return dict(found)


def _spec(sharding: Any, mesh: Mesh, ndim: int) -> Spec:
    """An ``HloSharding`` on ``mesh`` as one entry per dimension (``None``: whole)."""
    spec = PartitionSpec() if sharding is None else parse_flatten_op_sharding(sharding, mesh)[0]
    return _spec_of(spec, ndim)


def _spec_of(spec: PartitionSpec, ndim: int) -> Spec:
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec_to_json(spec, ndim))


def _container(value: Any) -> bool:
    return isinstance(value, tuple | list | dict)


class _Probes:
    """Probes each module call's array inputs and outputs; keeps what the compiler says."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.calls: list[tuple[str, str]] = []
        self.returned: list[int] = []
        self.seen: dict[tuple[int, str], dict[int, tuple[tuple[int, ...], list[Spec]]]] = (
            collections.defaultdict(dict)
        )

    def around(self, call: ModuleCall, run: Callable[..., Any]) -> Any:
        """Run ``call`` with its inputs and outputs passed through probes."""
        index = len(self.calls)
        self.calls.append((call.path, call.method))
        args, kwargs = self._probe(call.args, index, "in")
        with jax.named_scope(f"{_SCOPE}{index}"):
            output = self._probe(run(args, kwargs), index, "out")
        self.returned.append(index)
        return output

    def _probe(self, tree: Any, index: int, role: str) -> Any:
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: not _container(x))
        probed, position = [], 0
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and leaf.ndim:
                seen = functools.partial(self._seen, (index, role), position, leaf.shape)
                if self.mesh.size == 1:
                    seen(None)
                else:
                    leaf = _probe_p.bind(leaf, callback=seen)
                position += 1
            probed.append(leaf)
        return jax.tree.unflatten(treedef, probed)

    def _seen(
        self, key: tuple[int, str], position: int, shape: tuple[int, ...], sharding: Any
    ) -> None:
        _, specs = self.seen[key].setdefault(position, (tuple(shape), []))
        if (spec := _spec(sharding, self.mesh, len(shape))) not in specs:
            specs.append(spec)

    def table(self, traced: jax.stages.Traced) -> Table:
        """The calls whose probes the compiler answered (a dropped trace's never are)."""
        asked = self._constraints(traced.jaxpr)
        compiled = traced.lower().compile()
        calls = tuple(
            Call(
                *self.calls[i],
                self._first((i, "in")),
                self._first((i, "out")),
                tuple(sorted(asked.get(i, ()))),
                self._relaid(i),
            )
            for i in self.returned
            if (i, "in") in self.seen or (i, "out") in self.seen
        )
        found = collectives(compiled.as_text())
        return Table(calls, dict(self.mesh.shape), found, traced=len(self.returned))

    def _first(self, key: tuple[int, str]) -> dict[int, tuple[tuple[int, ...], Spec]]:
        """Each probed value's shape and the layout the partitioner first gave it."""
        return {p: (shape, specs[0]) for p, (shape, specs) in self.seen.get(key, {}).items()}

    def _relaid(self, index: int) -> tuple[str, ...]:
        """The other layouts a recomputation (``remat``) gave call ``index``'s values."""
        return tuple(
            f"{'input' if role == 'in' else 'output'} {position} also {spec_text(spec)}"
            for role in ("out", "in")
            for position, (_, specs) in sorted(self.seen.get((index, role), {}).items())
            for spec in specs[1:]
        )

    def _constraints(self, program: jcore.ClosedJaxpr) -> dict[int, list[str]]:
        """Call index -> the sharding constraints traced in its scope, not a child's."""
        found: dict[int, list[str]] = collections.defaultdict(list)
        for stack, eqn in scoped_equations(program.jaxpr):
            calls = _SCOPE_RE.findall(stack)
            if eqn.primitive.name != "sharding_constraint" or not calls:
                continue
            sharding, aval = eqn.params["sharding"], eqn.invars[0].aval
            spec = _spec_of(sharding.spec, aval.ndim)
            shape = "x".join(map(str, aval.shape))
            found[int(calls[-1])].append(f"{shape} to {render(spec, dict(sharding.mesh.shape))}")
        return found


@kept
def activation_table(side: Side, rows: int = BATCH_SIZE) -> Table:
    """What the partitioner makes of each module call of ``side``'s forward on its mesh.

    The forward of an abstract batch of ``rows`` from abstract parameters, placed as the
    side places them, is compiled once with probes (see the module); nothing runs. The
    table is kept for the scope: every check comparing the side's layouts shares it.
    """
    case = side.case
    probes = _Probes(case.devices)
    runner = side.runner
    params = runner.pack(abstract_params(side))
    context = runner.context(case.devices, abstract=True)
    batch = abstract_batch(case, rows)
    return probes.table(jax.jit(runner.intercepted(probes.around)).trace(params, context, batch))


@kept
def step_table(side: Side, rows: int = BATCH_SIZE) -> Table:
    """:func:`activation_table` of ``side``'s train step: its training forward's calls.

    The step (:func:`~conformance.runtime.aot.workload_trainer`'s) of an abstract batch of
    ``rows`` from an abstract train state, placed as the side places it, compiled once
    with probes; the partitioner lays the forward's values out knowing the backward pass
    that follows.
    """
    case = side.case
    probes = _Probes(case.devices)
    trainer = workload_trainer(side)
    shardings = case.shardings(trainer.logical)
    step = trainer.step_fn_around(probes.around, trainer.tree(shardings))
    return probes.table(step.trace(trainer.abstract(shardings), abstract_batch(case, rows)))
