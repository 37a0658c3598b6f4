"""Programs lowered ahead of time for a mesh this host need not run on: nothing allocated.

A side's forward and train step are lowered with abstract arguments
(``jax.ShapeDtypeStruct`` with the shardings the case resolves on its mesh), so the
mesh may be one of a TPU slice described by libtpu (:mod:`conformance.core.tpu`), at
production size. :func:`compile_for_production` compiles them with XLA's defaults, as
production code compiles, whatever the run's XLA level.

Each comes as a :class:`Program`, which names the outputs the harness leaves for the
compiler to place (the forward's, the step's metrics and gradients, the decode call's
logits): :func:`placements` reads the shardings the compiler chose for them, per leaf,
in canonical paths. Everything else (parameters, the train state, the KV cache, the
batch) goes in and comes out with the shardings the case resolves from the logical
names: :func:`held` reads those back from the executable, per leaf, in canonical paths,
with the arguments the program does not read marked so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from conformance.contract import Batch, vocab_tiles
from conformance.core.sharding import spec_to_json
from conformance.core.trees import Flat, flatten, map_paths
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.generation import step_batch
from conformance.runtime.live import Side, Trainer


def batch_rows(case: Case) -> int:
    """Rows of an abstract batch on ``case``'s mesh.

    :data:`BATCH_SIZE`, or one row per device when the mesh has more devices than that
    (a TPU slice), as a production step with ``per_device_batch_size`` 1 has: every
    batch shard then holds the same whole number of rows.
    """
    return max(BATCH_SIZE, case.mesh.size if case.mesh is not None else 1)


def abstract_batch(case: Case, rows: int) -> Batch:
    """The family's batch of ``rows`` as ``jax.ShapeDtypeStruct`` leaves, batch-sharded."""
    return _abstract(case, case.family.batch(case.bound, rows))


def _abstract(case: Case, batch: Batch) -> Batch:
    """``batch``'s shapes and dtypes, its batch dimension sharded as :meth:`Case.place` does."""
    sharding = case.batch_sharding()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch)


def abstract_params(side: Side) -> dict[str, jax.ShapeDtypeStruct]:
    """``side``'s parameters as ``jax.ShapeDtypeStruct`` leaves, placed as it places them."""
    shardings = side.shardings()
    return {
        path: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=shardings[path])
        for path, spec in side.runner.specs.items()
    }


@dataclasses.dataclass(frozen=True)
class Program:
    """One side's program, lowered on its mesh: its arguments, and how its outputs are laid.

    The arguments the harness passed stay named by their leaves' paths, since a backend
    packs them in its own order, beside values of its own (its RNG context).
    """

    lowered: jax.stages.Lowered
    placed: Mapping[int, str]
    """``{output position: name}`` of the outputs jit is given no sharding for."""
    kept: Mapping[int, str]
    """``{output position: name}`` of the outputs jit keeps in the argument's shardings."""
    arguments: Mapping[str, Flat]
    """``{name: {path: abstract leaf}}``: the flat arguments the harness passed."""
    cache: frozenset[str] = frozenset()
    """Names among :attr:`arguments` and :attr:`kept` holding a KV cache, whose paths
    map by the family's path rules rather than as parameters do."""


def lowered_forward(side: Side, batch: Batch) -> Program:
    """``side``'s forward of ``batch`` from abstract parameters, lowered on its mesh.

    The compiler places both outputs: the logits and the sown hidden states.
    """
    params = abstract_params(side)
    lowered = side.runner.lowered_forward(params, batch)
    return Program(
        lowered, {0: "logits", 1: "hidden"}, {}, {"params": params, "batch": _leaves(batch)}
    )


def workload_trainer(side: Side) -> Trainer:
    """``side``'s trainer as the case's config trains, for a step lowered on its mesh.

    Its loss is computed in the slices the config tiles its vocabulary in
    (:func:`~conformance.contract.vocab_tiles`: a production workload's, such as
    MaxText's 70B ones), whole logits otherwise.
    """
    return side.trainer(vocab_tiles=vocab_tiles(side.case.family, side.case.config))


def lowered_train_step(side: Side, batch: Batch) -> Program:
    """``side``'s train step of ``batch`` from an abstract train state, lowered on its mesh.

    The step is :func:`workload_trainer`'s. The new state keeps the state's shardings;
    the compiler places the metrics (the loss and the gradients).
    """
    trainer = workload_trainer(side)
    shardings = side.case.shardings(trainer.logical)
    step = trainer.step_fn(trainer.tree(shardings))
    state = trainer.abstract(shardings)
    arguments = {"state": _leaves(state), "batch": _leaves(batch)}
    return Program(step.lower(state, batch), {1: "metrics"}, {0: "state"}, arguments)


def lowered_decode_step(side: Side, rows: int) -> Program:
    """One decode call of ``side`` (a token per row against an abstract KV cache), lowered.

    Parameters, cache and the token batch are abstract, sharded on the side's mesh. The
    new cache keeps the cache's shardings; the compiler places the logits.
    """
    case = side.case
    decoder = side.decoder(rows)
    shardings = case.shardings(decoder.logical)
    cache = {
        path: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=shardings[path])
        for path, spec in decoder.specs.items()
    }
    at = np.zeros((rows, 1), np.int32)
    batch = _abstract(case, step_batch(at, at))
    params = abstract_params(side)
    lowered = decoder.lowered("decode", params, cache, batch, shardings)
    arguments = {"params": params, "cache": cache, "batch": _leaves(batch)}
    return Program(lowered, {0: "logits"}, {1: "cache"}, arguments, frozenset({"cache"}))


NOT_READ = "(not read by the program)"
"""The spec :func:`held` gives an argument the compiled program never reads."""


def _leaves(tree: Any, nones: bool = False) -> Flat:
    """``tree``'s leaves by path, an ``nnx.Variable`` as its value.

    ``None`` is no leaf, as in any pytree, unless ``nones`` (the sharding jax gives an
    argument the program never reads).
    """
    flat = flatten(tree, is_leaf=lambda x: (nones and x is None) or isinstance(x, nnx.Variable))
    return {p: v.get_value() if isinstance(v, nnx.Variable) else v for p, v in flat.items()}


def _spec(leaf: jax.ShapeDtypeStruct) -> Any:
    """``leaf``'s sharding as the goldens and reports write it.

    A ``NamedSharding``'s spec as a list with an entry per dimension (``None``, a mesh
    axis, or axes), no sharding as :data:`NOT_READ`, any other as its text.
    """
    sharding = leaf.sharding
    if sharding is None:
        return NOT_READ
    if isinstance(sharding, NamedSharding):
        return spec_to_json(sharding.spec, len(leaf.shape))
    return str(sharding)


def _specs(side: Side, name: str, flat: Flat, cache: bool = False) -> dict[str, Any]:
    """``{"<name>/<canonical path>": spec}`` of ``flat``'s abstract leaves.

    A ``cache``'s paths map by the side's path rules; any other by :meth:`Side.canonical`,
    which also moves layouts and maps state that mirrors the parameters.
    """
    if cache:
        renamed = map_paths(side.path_rules(), flat)
        canonical = {renamed[p]: leaf for p, leaf in flat.items()}
    else:
        canonical = side.canonical(flat)
    return {"/".join(filter(None, (name, p))): _spec(leaf) for p, leaf in canonical.items()}


def placements(side: Side, program: Program, compiled: Any) -> dict[str, Any]:
    """The sharding the compiler chose for each leaf of ``program``'s placed outputs.

    ``{"<output>/<canonical path>": spec}``: a ``NamedSharding``'s spec as a list with
    an entry per dimension (``None``, a mesh axis, or axes), any other sharding as its
    text. The same on both sides when they place their outputs alike.
    """
    outputs = compiled.out_info
    found: dict[str, Any] = {}
    for position, name in program.placed.items():
        found |= _specs(side, name, _leaves(outputs[position]))
    return found


def held(side: Side, program: Program, compiled: Any) -> dict[str, Any]:
    """The shardings ``compiled`` takes the harness's arguments in and keeps outputs in.

    ``{"<argument or output>/<canonical path>": spec}``, read from the executable: every
    leaf of the parameters, the train state, the KV cache and the batch as the program
    takes it (:data:`NOT_READ` for one it never reads), and of the new state or cache
    as it returns them. An argument position is named by the paths of its leaves; the
    values a backend passes of its own (its RNG context) are left out. Raises
    ``LookupError`` when an argument the harness passed is found at no position.
    """
    names = {frozenset(flat): name for name, flat in program.arguments.items()}
    found: dict[str, Any] = {}
    for info, sharding in zip(compiled.args_info[0], compiled.input_shardings[0], strict=True):
        flat_info, flat_sharding = _leaves(info), _leaves(sharding, nones=True)
        name = names.pop(frozenset(flat_info), None)
        if name is None:
            continue
        abstract = {
            p: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=flat_sharding[p])
            for p, i in flat_info.items()
        }
        found |= _specs(side, name, abstract, name in program.cache)
    if names:
        missing = ", ".join(sorted(names.values()))
        raise LookupError(f"{side.name}'s compiled program takes no argument of its {missing}")
    outputs = compiled.out_info
    for position, name in program.kept.items():
        found |= _specs(side, f"new {name}", _leaves(outputs[position]), name in program.cache)
    return found


@contextlib.contextmanager
def _full_optimisation() -> Iterator[None]:
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@contextlib.contextmanager
def traced_as_production() -> Iterator[None]:
    """Programs lowered inside trace with jax's default matmul precision, as production's.

    The harness runs at ``highest`` precision for the numbers the CPU compares; a TPU
    program traced so contracts bfloat16 operands in float32 (several passes per
    matmul), which is not the program production runs, and which libtpu's Mosaic
    refuses in a Pallas kernel (MaxText's sparse MoE ``gmm``: "Bad lhs type").
    """
    with jax.default_matmul_precision("default"):
        yield


def compile_for_production(lowered: jax.stages.Lowered) -> Any:
    """``lowered`` compiled with XLA's default optimisations (a ``jax.stages.Compiled``).

    The run's XLA level (``--xla-opt low``) is restored after; what a program needs in
    memory depends on the passes, so a fit is judged as production compiles.
    """
    with _full_optimisation():
        return lowered.compile()
