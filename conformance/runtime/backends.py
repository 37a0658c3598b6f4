"""The two sides of every comparison: build, place and run a family under Linen and NNX.

Parameters of both sides are handled as flat ``{canonical path: array}`` dicts, so that
transplanting, comparing and reporting never depend on how a backend nests its trees.
Runners are memoised per ``(family, config, quant)`` in the active
:class:`~conformance.core.scope.Scope`: their jitted functions compile once per input sharding
and are reused by every check in the scope, and released with it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops
from flax.nnx import variablelib
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from qwix import PtqProvider, QuantizationProvider, quantize_params

from conformance.contract import Batch, Family, persistent_types, quantization_scope
from conformance.core.scope import scoped
from conformance.core.sharding import Logical, linen_logical, nnx_logical, ranked
from conformance.core.trees import (
    Flat,
    LeafSpec,
    flatten,
    flatten_state,
    join_path,
    refill,
    specs,
    unflatten,
    variable_kind,
)
from conformance.runtime.calls import Around, linen_calls, nnx_calls
from conformance.runtime.provenance import Built, LinenBridges, nnx_built
from conformance.runtime.quant import MODES, quantize_linen, quantize_nnx

HIDDEN_STATES = "hidden_states"

INTERMEDIATES = "intermediates"
"""Flax's collection (Linen) of values a model sows (``nnx.Intermediate`` in NNX)."""

OVERWRITE = fp8_ops.OVERWRITE_WITH_GRADIENT
"""Flax's collection (Linen) and Variable type name (NNX) of values a train step replaces
with their gradient instead of optimising them: FP8 scales and amax histories."""


def persistent_collections(family: Family) -> dict[str, str]:
    """Each Linen collection of ``family``'s persistent state, to its Variable type's name.

    The type's name is how train states name such a leaf's kind on both backends
    (:class:`~conformance.contract.PersistentState`). Collections are named as
    Flax's bridges name a Variable type's: a ``ToLinen`` module puts an NNX ``MoEBiasVar``
    in the Linen collection ``"MoEBiasVar"``, an ``nnx.BatchStat`` in ``"batch_stats"``.
    """
    return {
        variablelib.variable_name_from_type(kind, allow_register=True): kind.__name__
        for kind in persistent_types(family)
    }


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
    return None if quant is None else MODES[quant].provider(quantization_scope(family, config))


class Runner(abc.ABC):
    """A family's model on one backend: abstract layout, sharded init and a jitted forward.

    Written once over the backend's primitives: :meth:`pack` and :meth:`unpack` move
    parameters between flat dicts and the backend's trees, :meth:`context` is what its
    programs take beside parameters and batch, :meth:`apply` calls the model in a traced
    program, and :meth:`_init_impl` with :meth:`_init_args` creates parameters. With
    ``quant`` (a name in :data:`conformance.runtime.quant.MODES`) the model is quantized by
    Qwix: its parameters are the quantized layout (``qvalue``/``scale`` leaves for PTQ),
    and :meth:`quantize` turns float parameters into them.
    """

    _init_static: tuple[int, ...] = ()
    """Which of :meth:`_init_args` are static arguments of the init program."""

    def __init__(self, family: Family, config: Any, quant: str | None) -> None:
        self.family, self.config = family, config
        self.provider = _provider(family, config, quant)
        self.specs: dict[str, LeafSpec] = {}
        """Every parameter's shape and dtype, by path."""
        self.logical: dict[str, Logical] = {}
        """Every parameter's logical axis names, by path."""
        self.held: dict[str, str] = {}
        """What the model holds outside its parameters, by path: its kind."""
        self._forward = jax.jit(self._forward_impl)
        self._init_fns: dict[Any, Any] = {}

    @abc.abstractmethod
    def pack(self, flat: Mapping[str, Any]) -> Any:
        """The backend's parameter tree holding ``flat``, keyed by this side's paths.

        Leaves may be values, shardings or ``jax.ShapeDtypeStruct`` leaves.
        """

    @abc.abstractmethod
    def unpack(self, tree: Any) -> Flat:
        """The flat ``{path: value}`` dict of a parameter tree :meth:`pack` makes."""

    @abc.abstractmethod
    def context(self, mesh: Mesh | None = None, *, abstract: bool = False) -> Any:
        """What the model's programs take beside parameters and batch, on ``mesh``.

        It is replicated, and ``jax.ShapeDtypeStruct`` leaves when ``abstract``.
        """

    @abc.abstractmethod
    def apply(
        self,
        params: Any,
        context: Any,
        batch: Batch,
        *,
        held: Mapping[str, Any] | None = None,
        collect: str = INTERMEDIATES,
        call: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """In a traced program: the model's output for ``batch`` and a collection after it.

        The output is the logits, unless ``call`` (keywords the model is called with
        beside the batch) asks for more. The collection is ``collect``: what the model
        sowed, by default. ``held`` sets collections beside the parameters first, by
        Linen collection name.
        """

    @abc.abstractmethod
    def intercepted(self, around: Around) -> Callable[[Any, Any, Batch], jax.Array]:
        """The forward as a traceable ``f(params, context, batch) -> logits``.

        Every module method call it traces runs through ``around``
        (:mod:`conformance.runtime.calls`); trace it anew for each ``around``.
        """

    @abc.abstractmethod
    def _init_impl(self, *args: Any) -> Any:
        """In a traced program: the parameter tree initialised from :meth:`_init_args`."""

    @abc.abstractmethod
    def _init_args(self, seed: int) -> tuple[Any, ...]:
        """The init program's arguments for ``seed``."""

    @abc.abstractmethod
    def _ptq(self, float_params: Flat) -> Flat:
        """PTQ-quantized parameters made from the float runner's ``float_params``."""

    def quantize(self, float_params: Flat) -> Flat:
        """Quantized parameters for this runner, made from the float runner's ``float_params``."""
        if not isinstance(self.provider, PtqProvider):
            return float_params
        return self._ptq(float_params)

    def init(self, seed: int, shardings: Mapping[str, NamedSharding] | None = None) -> Flat:
        """Initialise parameters from ``seed``, created directly with ``shardings``.

        The init program compiles once per ``shardings``.
        """
        key = tuple(sorted(shardings.items())) if shardings else None
        if key not in self._init_fns:
            self._init_fns[key] = jax.jit(
                self._init_impl,
                static_argnums=self._init_static,
                out_shardings=self.pack(shardings) if shardings else None,
            )
        return self.unpack(self._init_fns[key](*self._init_args(seed)))

    def _forward_impl(self, params: Any, context: Any, batch: Batch) -> tuple[jax.Array, Any]:
        logits, sown = self.apply(params, context, batch)
        return logits, _sown_hidden(sown)

    def forward(self, params: Flat, batch: Batch) -> tuple[jax.Array, jax.Array | None]:
        """Logits and sown per-block hidden states for ``batch``."""
        return self._forward(self.pack(params), self.context(mesh_of(params)), batch)

    def lowered_forward(self, params: Flat, batch: Batch) -> jax.stages.Lowered:
        """The program :meth:`forward` runs for these arguments, lowered, not compiled.

        ``params`` and ``batch`` may be ``jax.ShapeDtypeStruct`` leaves with shardings;
        the :meth:`context` goes in abstractly, replicated on the parameters' mesh, so
        nothing is computed (the mesh may be one this host cannot run on).
        """
        context = self.context(mesh_of(params), abstract=True)
        return self._forward.lower(self.pack(params), context, batch)


class LinenRunner(Runner):
    """A family's Linen module: the :class:`Runner` primitives over ``module.apply``."""

    def __init__(self, family: Family, config: Any, quant: str | None = None) -> None:
        super().__init__(family, config, quant)
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
        self.held = {
            path: f"collection {collection!r}"
            for collection, tree in variables.items()
            if collection != "params"
            for path in flatten(tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        }
        self.kept: dict[str, dict[str, LeafSpec]] = {
            collection: specs(flatten(nn.meta.unbox(variables[collection])))
            for collection in (OVERWRITE, *persistent_collections(family))
            if collection in variables
        }
        """Collections a train state keeps beside ``params``, by collection and path: the
        FP8-style values a step overwrites with their gradient (:data:`OVERWRITE`) and
        the family's persistent state (:func:`persistent_collections`); usually none."""
        self._abstract = nn.meta.unbox(boxed)
        self.specs = specs(flatten(self._abstract))
        self.logical = ranked(linen_logical(boxed), self.specs)
        self._init_kept = jax.jit(self._init_kept_impl)
        self._quantize = jax.jit(lambda params: flatten(quantize_params(unflatten(params), boxed)))

    def pack(self, flat: Mapping[str, Any]) -> Any:
        """The module's parameter tree (with Qwix's quantized nodes, if any) holding ``flat``."""
        return refill(self._abstract, flat)

    def unpack(self, tree: Any) -> Flat:
        """The flat dict of a ``params`` tree."""
        return flatten(tree)

    def context(self, mesh: Mesh | None = None, *, abstract: bool = False) -> None:
        """Nothing: a Linen module's programs take parameters and batch only."""
        return None

    def apply(
        self,
        params: Any,
        context: None,
        batch: Batch,
        *,
        held: Mapping[str, Any] | None = None,
        collect: str = INTERMEDIATES,
        call: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """``module.apply`` with ``collect`` mutable (see :meth:`Runner.apply`)."""
        variables = {"params": params, **(held or {})}
        inputs = model_inputs(batch)
        out, state = self.module.apply(variables, *inputs, **(call or {}), mutable=[collect])
        return out, state.get(collect, {})

    def _ptq(self, float_params: Flat) -> Flat:
        return self._quantize(float_params)

    def intercepted(self, around: Around) -> Callable[[Any, Any, Batch], jax.Array]:
        """``module.apply`` inside :func:`~conformance.runtime.calls.linen_calls`."""

        def forward(params: Any, context: None, batch: Batch) -> jax.Array:
            with linen_calls(around):
                return self.module.apply({"params": params}, *model_inputs(batch))

        return forward

    def _init_impl(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        return nn.meta.unbox(self.module.init(key, *model_inputs(batch))["params"])

    def _init_args(self, seed: int) -> tuple[jax.Array, Batch]:
        return jax.random.key(seed), self.family.batch(self.config, 1)

    def _init_kept_impl(self, key: jax.Array, batch: Batch) -> dict[str, Flat]:
        variables = nn.meta.unbox(self.module.init(key, *model_inputs(batch)))
        return {collection: flatten(variables[collection]) for collection in self.kept}

    def init_kept(self) -> dict[str, Flat]:
        """The :attr:`kept` collections as ``init`` makes them (``{}`` when there are none)."""
        if not self.kept:
            return {}
        return self._init_kept(*self._init_args(0))


class NnxRunner(Runner):
    """A family's NNX module: the :class:`Runner` primitives over ``nnx.merge``."""

    _init_static = (0,)

    def __init__(self, family: Family, config: Any, quant: str | None = None) -> None:
        super().__init__(family, config, quant)
        abstract = nnx.eval_shape(lambda: self.build(0))
        self.abstract: nnx.Module = abstract
        """The model :meth:`build` makes, abstractly: traced once, here."""
        self.built: Built = nnx_built(abstract)
        """The model class built and the bridge modules it holds (``ToNNX``)."""
        self.graphdef, params, self._abstract_rest = nnx.split(abstract, nnx.Param, ...)
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(params)}
        self._abstract_vars = flatten_state(params)
        self.specs = specs(self._abstract_vars)
        self.logical = ranked(nnx_logical(params), self.specs)
        self.held = {
            path: variable_kind(var) for path, var in flatten_state(self._abstract_rest).items()
        }
        self.rng_streams: list[str] = sorted(
            path
            for path, var in flatten_state(self._abstract_rest).items()
            if isinstance(var, nnx.RngState)
        )
        """Paths of the model's RNG stream variables (kept out of train states)."""
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

    def _ptq(self, float_params: Flat) -> Flat:
        """The float model holding ``float_params``, quantized by Qwix as a user would."""
        source = nnx_runner(self.family, self.config)
        rest = source.rest(mesh_of(float_params))
        return self.unpack(self._convert(source.pack(float_params), rest))

    def _convert_impl(self, params: nnx.State, rest: nnx.State) -> nnx.State:
        graphdef = nnx_runner(self.family, self.config).graphdef
        with nnx.use_eager_sharding(False):
            model = self._quantized(nnx.merge(graphdef, params, rest))
        return nnx.state(model, nnx.Param)

    def pack(self, flat: Mapping[str, Any]) -> nnx.State:
        """An ``nnx.State`` of Params holding ``flat`` (keyed by canonical path)."""
        return nnx.from_flat_state(
            [(self._keys[p], self._abstract_vars[p].replace(v)) for p, v in flat.items()]
        )

    def unpack(self, tree: nnx.State) -> Flat:
        """The flat dict of the values of an ``nnx.State`` of Params."""
        return {path: var.get_value() for path, var in flatten_state(tree).items()}

    def context(self, mesh: Mesh | None = None, *, abstract: bool = False) -> nnx.State:
        """The model's non-parameter state: :meth:`rest`, or :meth:`abstract_rest`."""
        return self.abstract_rest(mesh) if abstract else self.rest(mesh)

    def apply(
        self,
        params: nnx.State,
        context: nnx.State,
        batch: Batch,
        *,
        held: Mapping[str, Any] | None = None,
        collect: str = INTERMEDIATES,
        call: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Any]:
        """The merged model called under ``nnx.capture`` (see :meth:`Runner.apply`).

        A Linen collection name stands for the NNX Variable type Flax's bridges give it.
        """
        model = nnx.merge(self.graphdef, params, context)
        for state in (held or {}).values():
            nnx.update(model, state)
        out, sown = nnx.capture(model, nnx.Intermediate)(*model_inputs(batch), **(call or {}))
        if collect == INTERMEDIATES:
            return out, sown
        return out, nnx.state(model, nnx.variable_type_from_name(collect, allow_register=True))

    def intercepted(self, around: Around) -> Callable[[Any, Any, Batch], jax.Array]:
        """The merged model called inside :func:`~conformance.runtime.calls.nnx_calls`."""

        def forward(params: nnx.State, context: nnx.State, batch: Batch) -> jax.Array:
            model = nnx.merge(self.graphdef, params, context)
            with nnx_calls(model, around):
                return nnx.capture(model, nnx.Intermediate)(*model_inputs(batch))[0]

        return forward

    def _init_impl(self, seed: int) -> nnx.State:
        return nnx.split(self.build(seed), nnx.Param, ...)[1]

    def _init_args(self, seed: int) -> tuple[int]:
        return (seed,)

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
