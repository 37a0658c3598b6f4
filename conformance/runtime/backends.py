"""The two sides of every comparison: build, place and run a family under Linen and NNX.

Parameters of both sides are handled as flat ``{canonical path: array}`` dicts, so that
transplanting, comparing and reporting never depend on how a backend nests its trees.
Runners are memoised per ``(family, config, quant)`` in the active
:class:`~conformance.core.scope.Scope`: their jitted functions compile once per input sharding
and are reused by every check in the scope, and released with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops
from flax.nnx import variablelib
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from qwix import PtqProvider, QuantizationProvider, quantize_params

from conformance.contract import Batch, Family
from conformance.core.distributed import place
from conformance.core.scope import scoped
from conformance.core.sharding import Logical, linen_logical, nnx_logical
from conformance.core.trees import (
    Flat,
    LeafSpec,
    check_bijection,
    flatten,
    flatten_state,
    join_path,
    map_paths,
    refill,
    specs,
    unflatten,
    variable_kind,
)
from conformance.runtime.provenance import Built, LinenBridges, nnx_built
from conformance.runtime.quant import MODES, quantize_linen, quantize_nnx

HIDDEN_STATES = "hidden_states"

OVERWRITE = fp8_ops.OVERWRITE_WITH_GRADIENT
"""Flax's collection (Linen) and Variable type name (NNX) of values a train step replaces
with their gradient instead of optimising them: FP8 scales and amax histories."""


def persistent_collections(family: Family) -> dict[str, str]:
    """Each Linen collection of ``family``'s persistent state, to its Variable type's name.

    The type's name is how train states name such a leaf's kind on both backends
    (:attr:`~conformance.contract.Family.persistent_state`). Collections are named as
    Flax's bridges name a Variable type's: a ``ToLinen`` module puts an NNX ``MoEBiasVar``
    in the Linen collection ``"MoEBiasVar"``, an ``nnx.BatchStat`` in ``"batch_stats"``.
    """
    return {
        variablelib.variable_name_from_type(kind, allow_register=True): kind.__name__
        for kind in family.persistent_state
    }


class TransplantError(ValueError):
    """Parameters could not be moved to the other side without loss."""


def model_inputs(batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The positional arguments both sides' modules are called with: tokens, positions, segments."""
    return batch.tokens, batch.positions, batch.segment_ids


def _sown_hidden(tree: Any) -> jax.Array | None:
    """The ``hidden_states`` intermediate a family sows, if any."""
    hits = [leaf for path, leaf in flatten(tree).items() if HIDDEN_STATES in path.split("/")]
    return hits[0] if len(hits) == 1 else None


def mesh_of(flat: Mapping[str, Any]) -> Mesh | None:
    """The device mesh ``flat``'s arrays are placed on, or ``None`` if they are not sharded."""
    sharding = getattr(next(iter(flat.values()), None), "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _provider(family: Family, config: Any, quant: str | None) -> QuantizationProvider | None:
    return None if quant is None else MODES[quant].provider(family.quantization_scope(config))


class LinenRunner:
    """A family's Linen module: abstract layout, sharded init and a jitted forward.

    With ``quant`` (a name in :data:`conformance.runtime.quant.MODES`) the module is quantized
    by Qwix: its parameters are the quantized layout (``qvalue``/``scale`` leaves for
    PTQ), and :meth:`quantize` turns float parameters into them.
    """

    def __init__(self, family: Family, config: Any, quant: str | None = None) -> None:
        self.family, self.config = family, config
        self.provider = _provider(family, config, quant)
        module = family.linen_module(config)
        self.module = module if self.provider is None else quantize_linen(module, self.provider)
        example = model_inputs(family.batch(config, 1))
        bridges = LinenBridges()
        with bridges.watching():
            variables = jax.eval_shape(self.module.init, jax.random.key(0), *example)
        self.abstract_variables: Mapping[str, Any] = variables
        """What ``init`` returns, abstractly (boxed), by collection: traced once, here."""
        self.built: Built = bridges.built(module)
        """The model class built and the bridge modules it ran (``ToLinen``)."""
        boxed = variables["params"]
        self.held: dict[str, str] = {
            path: f"collection {collection!r}"
            for collection, tree in variables.items()
            if collection != "params"
            for path in flatten(tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        }
        """What the module holds outside ``params``, by path within its collection."""
        self.kept: dict[str, dict[str, LeafSpec]] = {
            collection: specs(flatten(nn.meta.unbox(variables[collection])))
            for collection in (OVERWRITE, *persistent_collections(family))
            if collection in variables
        }
        """Collections a train state keeps beside ``params``, by collection and path: the
        FP8-style values a step overwrites with their gradient (:data:`OVERWRITE`) and
        the family's persistent state (:func:`persistent_collections`); usually none."""
        self.logical: dict[str, Logical] = linen_logical(boxed)
        self._abstract = nn.meta.unbox(boxed)
        self.specs: dict[str, LeafSpec] = specs(flatten(self._abstract))
        self._forward = jax.jit(self._forward_impl)
        self._init_fns: dict[Any, Any] = {}
        self._init_kept = jax.jit(self._init_kept_impl)
        self._quantize = jax.jit(lambda params: flatten(quantize_params(unflatten(params), boxed)))

    def tree(self, flat: Mapping[str, Any]) -> Any:
        """The module's parameter tree (with Qwix's quantized nodes, if any) holding ``flat``."""
        return refill(self._abstract, flat)

    def quantize(self, float_params: Flat) -> Flat:
        """Quantized parameters for this runner, made from the float runner's ``float_params``."""
        if not isinstance(self.provider, PtqProvider):
            return float_params
        return self._quantize(float_params)

    def _init_impl(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        return nn.meta.unbox(self.module.init(key, *model_inputs(batch))["params"])

    def init(self, seed: int, shardings: Mapping[str, NamedSharding] | None = None) -> Flat:
        """Initialise parameters from ``seed``, created directly with ``shardings``."""
        key = tuple(sorted(shardings.items())) if shardings else None
        if key not in self._init_fns:
            out = self.tree(shardings) if shardings else None
            self._init_fns[key] = jax.jit(self._init_impl, out_shardings=out)
        batch = self.family.batch(self.config, 1)
        return flatten(self._init_fns[key](jax.random.key(seed), batch))

    def _init_kept_impl(self, key: jax.Array, batch: Batch) -> dict[str, Flat]:
        variables = nn.meta.unbox(self.module.init(key, *model_inputs(batch)))
        return {collection: flatten(variables[collection]) for collection in self.kept}

    def init_kept(self) -> dict[str, Flat]:
        """The :attr:`kept` collections as ``init`` makes them (``{}`` when there are none)."""
        if not self.kept:
            return {}
        return self._init_kept(jax.random.key(0), self.family.batch(self.config, 1))

    def _forward_impl(self, params: dict[str, Any], batch: Batch) -> tuple[jax.Array, Any]:
        logits, state = self.module.apply(
            {"params": params}, *model_inputs(batch), mutable=["intermediates"]
        )
        return logits, _sown_hidden(state)

    def forward(self, params: Flat, batch: Batch) -> tuple[jax.Array, jax.Array | None]:
        """Logits and sown per-block hidden states for ``batch``."""
        return self._forward(self.tree(params), batch)

    def lowered_forward(self, params: Flat, batch: Batch) -> jax.stages.Lowered:
        """The program :meth:`forward` runs for these arguments, lowered, not compiled.

        ``params`` and ``batch`` may be ``jax.ShapeDtypeStruct`` leaves with shardings.
        """
        return self._forward.lower(self.tree(params), batch)


class NnxRunner:
    """A family's NNX module: abstract layout, sharded init and a jitted forward.

    With ``quant``, the module is quantized by Qwix as in :class:`LinenRunner`.
    """

    def __init__(self, family: Family, config: Any, quant: str | None = None) -> None:
        self.family, self.config = family, config
        self.quant = quant
        self.provider = _provider(family, config, quant)
        abstract = nnx.eval_shape(lambda: self.build(0))
        self.abstract: nnx.Module = abstract
        """The model :meth:`build` makes, abstractly: traced once, here."""
        self.built: Built = nnx_built(abstract)
        """The model class built and the bridge modules it holds (``ToNNX``)."""
        self.graphdef, params, self._abstract_rest = nnx.split(abstract, nnx.Param, ...)
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(params)}
        self._abstract_vars = flatten_state(params)
        self.logical: dict[str, Logical] = nnx_logical(params)
        self.specs: dict[str, LeafSpec] = specs(self._abstract_vars)
        self.held: dict[str, str] = {
            path: variable_kind(var) for path, var in flatten_state(self._abstract_rest).items()
        }
        """What the model holds outside ``nnx.Param``: each Variable's type, by path."""
        self.rng_streams: list[str] = sorted(
            path
            for path, var in flatten_state(self._abstract_rest).items()
            if isinstance(var, nnx.RngState)
        )
        """Paths of the model's RNG stream variables (kept out of train states)."""
        self._forward = jax.jit(self._forward_impl)
        self._init_fns: dict[Any, Any] = {}
        self._rest: dict[Mesh | None, nnx.State] = {}
        self._convert = jax.jit(self._convert_impl)

    def build(self, seed: int) -> nnx.Module:
        """Construct the NNX module from ``seed`` (eager sharding off: the harness places)."""
        with nnx.use_eager_sharding(False):
            model = self.family.nnx_module(self.config, nnx.Rngs(seed))
            return self._quantized(model)

    def _quantized(self, model: nnx.Module) -> nnx.Module:
        if self.provider is None:
            return model
        example = model_inputs(self.family.batch(self.config, 1))
        return quantize_nnx(model, self.provider, example)

    def quantize(self, float_params: Flat) -> Flat:
        """Quantized parameters for this runner, made from the float runner's ``float_params``.

        The float model holding ``float_params`` is quantized by Qwix, as a user would.
        """
        if not isinstance(self.provider, PtqProvider):
            return float_params
        source = nnx_runner(self.family, self.config)
        rest = source.rest(mesh_of(float_params))
        quantized = self._convert(source.state(float_params), rest)
        return {path: var.get_value() for path, var in flatten_state(quantized).items()}

    def _convert_impl(self, params: nnx.State, rest: nnx.State) -> nnx.State:
        graphdef = nnx_runner(self.family, self.config).graphdef
        with nnx.use_eager_sharding(False):
            model = self._quantized(nnx.merge(graphdef, params, rest))
        return nnx.state(model, nnx.Param)

    def state(self, params: Flat) -> nnx.State:
        """An ``nnx.State`` of Params holding ``params`` (keyed by canonical path)."""
        return nnx.from_flat_state(
            [(self._keys[p], self._abstract_vars[p].replace(v)) for p, v in params.items()]
        )

    def init(self, seed: int, shardings: Mapping[str, NamedSharding] | None = None) -> Flat:
        """Initialise parameters from ``seed``, created directly with ``shardings``."""
        key = tuple(sorted(shardings.items())) if shardings else None
        if key not in self._init_fns:
            self._init_fns[key] = jax.jit(
                lambda s: nnx.split(self.build(s), nnx.Param, ...)[1],
                static_argnums=0,
                out_shardings=self.state(shardings) if shardings else None,
            )
        params = self._init_fns[key](seed)
        return {path: var.get_value() for path, var in flatten_state(params).items()}

    def rest(self, mesh: Mesh | None = None) -> nnx.State:
        """The model's non-parameter state (RNG streams and the like), replicated on ``mesh``.

        It is what a freshly built model holds, the same for any seed's parameters; it is
        computed once per mesh.
        """
        if mesh not in self._rest:
            out = None if mesh is None else NamedSharding(mesh, PartitionSpec())
            build = jax.jit(lambda: nnx.split(self.build(0), nnx.Param, ...)[2], out_shardings=out)
            self._rest[mesh] = build()
        return self._rest[mesh]

    def _forward_impl(
        self, params: nnx.State, rest: nnx.State, batch: Batch
    ) -> tuple[jax.Array, Any]:
        model = nnx.merge(self.graphdef, params, rest)
        logits, sown = nnx.capture(model, nnx.Intermediate)(*model_inputs(batch))
        return logits, _sown_hidden(sown)

    def forward(self, params: Flat, batch: Batch) -> tuple[jax.Array, jax.Array | None]:
        """Logits and sown per-block hidden states for ``batch``."""
        return self._forward(self.state(params), self.rest(mesh_of(params)), batch)

    def lowered_forward(self, params: Flat, batch: Batch) -> jax.stages.Lowered:
        """The program :meth:`forward` runs for these arguments, lowered, not compiled.

        ``params`` and ``batch`` may be ``jax.ShapeDtypeStruct`` leaves with shardings;
        the non-parameter state goes in abstractly, replicated on the parameters' mesh,
        so nothing is computed (the mesh may be one this host cannot run on).
        """
        return self._forward.lower(self.state(params), self.abstract_rest(mesh_of(params)), batch)

    def abstract_rest(self, mesh: Mesh | None = None) -> nnx.State:
        """:meth:`rest` as ``jax.ShapeDtypeStruct`` leaves, replicated on ``mesh``.

        What a program is lowered with on a mesh this host may not run on.
        """
        if mesh is None:
            return self._abstract_rest
        replicated = NamedSharding(mesh, PartitionSpec())
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
            self._abstract_rest,
        )


@scoped
def linen_runner(family: Family, config: Any, quant: str | None = None) -> LinenRunner:
    """The Linen runner for ``(family, config, quant)``."""
    return LinenRunner(family, config, quant)


@scoped
def nnx_runner(family: Family, config: Any, quant: str | None = None) -> NnxRunner:
    """The NNX runner for ``(family, config, quant)``."""
    return NnxRunner(family, config, quant)


def path_map(family: Family, config: Any) -> dict[str, str]:
    """``{Linen path: NNX path}`` from the family's rules, checked to be a bijection."""
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    mapping = map_paths(family.path_rules(config), linen.specs)
    check_bijection(mapping, nnx_.specs)
    return mapping


def transplant(
    source: Flat,
    mapping: Mapping[str, str],
    target: Mapping[str, LeafSpec],
    shardings: Mapping[str, NamedSharding] | None = None,
) -> Flat:
    """Move ``source`` parameters to the target side's paths, placed with ``shardings``.

    Guarantees what ``nnx.update`` does not: every target leaf receives a value, no
    source leaf is dropped, and shapes and dtypes agree; otherwise
    :class:`TransplantError` lists every offending path.
    """
    moved = {mapping.get(path, path): value for path, value in source.items()}
    problems = [
        f"  {p}: not set (no source leaf maps to it)" for p in sorted(set(target) - set(moved))
    ]
    problems += [f"  {p}: extra (no such target leaf)" for p in sorted(set(moved) - set(target))]
    for path in sorted(set(moved) & set(target)):
        got = LeafSpec.of(moved[path])
        if got != target[path]:
            problems.append(f"  {path}: source {got} != target {target[path]}")
    if problems:
        raise TransplantError("transplant would lose parameters:\n" + "\n".join(problems))
    if shardings is None:
        return moved
    return {path: place(value, shardings[path]) for path, value in moved.items()}
