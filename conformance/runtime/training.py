"""Jitted, sharded train steps for both backends: one trainer per backend.

A step maps ``(state, batch)`` to ``(next state, metrics)`` with metrics ``loss`` and
per-leaf ``grads``, jitted with explicit in and out shardings. Both backends step the
train state of :mod:`conformance.runtime.train_state` (the same canonical leaves, RNG
streams left out and drawn from the step counter) towards the objective of
:mod:`conformance.runtime.objective` (the loss, its auxiliary terms, micro-batches). With
``vocab_tiles > 1`` the family's
:meth:`~conformance.contract.Family.vocab_tiling_config` computes the loss inside the
model. :func:`conformance.checks.structure.check_structure` lists the RNG streams the NNX
state sets aside.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from conformance.contract import Backend, Batch, Family
from conformance.core.scope import scoped
from conformance.core.seams import seam
from conformance.core.sharding import Logical, nnx_logical
from conformance.core.trees import (
    Flat,
    flatten,
    flatten_state,
    join_path,
    mirrored_param,
    unflatten,
)
from conformance.runtime.backends import (
    OVERWRITE,
    linen_runner,
    mesh_of,
    nnx_runner,
    persistent_collections,
)
from conformance.runtime.calls import Around, linen_calls, nnx_calls
from conformance.runtime.objective import (
    loss_inputs,
    metrics,
    objective_of,
    refuse_accumulated_overwrite,
    sown_losses,
    with_aux,
)
from conformance.runtime.train_state import (
    STREAMS_SEED,
    NnxTrainState,
    OverwriteWithGradient,
    state_kind,
    step_streams,
)
from conformance.runtime.trainer import TrainerBase


def _differentiated(loss_fn: Callable[..., Any], wrt: Any) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of ``loss_fn`` by its first argument's ``wrt`` Variables.

    The harness's own transform runs in NNX graph mode whatever flax's defaults
    (``nnx_graph_mode``, ``nnx_graph_updates``), because a ``DiffState`` needs it; the
    model's own transforms inside ``loss_fn`` (``nnx.scan``, ``nnx.remat``) still follow
    the defaults, so a zoo that runs in tree mode is trained in tree mode.
    """
    return nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True, graph=True, graph_updates=True
    )


def _abstract(leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """``leaf``'s shape and dtype with ``sharding``: an argument nothing is allocated for."""
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class LinenTrainer(TrainerBase):
    """Linen train state (a nested dict) and its step, for one family config."""

    backend = Backend.LINEN

    def __init__(
        self,
        family: Family,
        config: Any,
        micro_batches: int = 1,
        quant: str | None = None,
        vocab_tiles: int = 1,
    ) -> None:
        super().__init__(family, config, micro_batches, vocab_tiles)
        self.runner = linen_runner(family, self.config, quant)
        self.kept = {
            path: collection for collection, leaves in self.runner.kept.items() for path in leaves
        }
        """The collection of each value the state's ``model`` keeps beside params, by
        path: :data:`OVERWRITE` values and the family's persistent state."""
        self._kinds = {OVERWRITE: OVERWRITE, **persistent_collections(family)}
        """Each kept collection's kind in :attr:`kinds`: persistent state by its type's name."""
        self.overwrite = {path for path, c in self.kept.items() if c == OVERWRITE}
        """Paths of :data:`OVERWRITE` values (a step replaces them with their gradient)."""
        refuse_accumulated_overwrite(bool(self.overwrite), micro_batches)
        self.streams = family.train_rngs
        params = {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in self.runner.specs.items()}
        kept = {
            collection: {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in leaves.items()}
            for collection, leaves in self.runner.kept.items()
        }
        self.abstract_state = jax.eval_shape(self._create_impl, params, kept)
        self.logical: dict[str, Logical] = {}
        for path in flatten(self.abstract_state):
            found = mirrored_param(path, self.runner.logical)
            self.logical[path] = None if found is None else self.runner.logical[found[1]]
        self._create = jax.jit(self._create_impl)

    @property
    def kinds(self) -> dict[str, str]:
        """What each train-state leaf is, by path (see :func:`state_kind`)."""
        found = {}
        for path in flatten(self.abstract_state):
            param = path.removeprefix("model/")
            if (collection := self.kept.get(param)) is not None:
                found[path] = self._kinds[collection]
            else:
                found[path] = "Param" if param in self.runner.specs else "OptState"
        return found

    def initial_state(self, params: Flat) -> dict[str, Any]:
        """A train state around ``params``: fresh optimizer state, step 0.

        The kept collections (:data:`OVERWRITE` values, persistent state), if the module
        has any, start as its ``init`` makes them.
        """
        return self._create(params, self.runner.init_kept())

    def _create_impl(self, params: Flat, kept: Mapping[str, Flat]) -> dict[str, Any]:
        nested = unflatten(params)
        step = jnp.zeros((), jnp.int32)
        held = {path: value for leaves in kept.values() for path, value in leaves.items()}
        model = unflatten({**params, **held}) if held else nested
        return {"model": model, "optimizer": {"opt_state": self.tx.init(nested), "step": step}}

    def tree(self, by_path: Mapping[str, Any]) -> Any:
        """The train state's tree holding ``by_path``'s arrays or shardings, by path."""
        return jax.tree_util.tree_map_with_path(
            lambda keys, _: by_path[join_path(keys)], self.abstract_state
        )

    def abstract(self, shardings: Mapping[str, NamedSharding]) -> Any:
        """The train state as ``jax.ShapeDtypeStruct`` leaves with ``shardings`` (by path).

        What a step lowers for a mesh without allocating anything.
        """
        return jax.tree_util.tree_map_with_path(
            lambda keys, leaf: _abstract(leaf, shardings[join_path(keys)]), self.abstract_state
        )

    def _streams(self, step: jax.Array) -> dict[str, jax.Array]:
        """The RNG streams of step number ``step``: a key per stream, a function of both."""
        base = jax.random.fold_in(jax.random.key(STREAMS_SEED), step)
        return {name: jax.random.fold_in(base, i) for i, name in enumerate(self.streams)}

    def _split(self, model: Any) -> tuple[Any, Any, dict[str, Any]]:
        """The state's ``model`` as ``(params, overwrite, persistent)``.

        ``overwrite`` is the :data:`OVERWRITE` tree (empty without FP8); ``persistent``
        the persistent state's trees by collection (empty without).
        """
        if not self.kept:
            return model, {}, {}
        flat = flatten(model)
        params = unflatten({p: v for p, v in flat.items() if p not in self.kept})
        kept = {
            collection: unflatten({p: v for p, v in flat.items() if self.kept.get(p) == collection})
            for collection in sorted(set(self.kept.values()))
        }
        return params, kept.pop(OVERWRITE, {}), kept

    def _loss_fn(
        self, rngs: dict[str, jax.Array], persistent: Mapping[str, Any], cross_entropy: bool = True
    ) -> Any:
        """``(params, overwrite, micro) -> (value, (count, aux))``: what a step differentiates.

        ``persistent`` collections are given as they are, not differentiated. Without
        ``cross_entropy`` the value is the auxiliary losses' part alone.
        """
        module = self.runner.module
        predicts = self.predicts
        objective = objective_of(self.loss, self.tiled, bool(self.overwrite), predicts)

        def loss_fn(params: Any, overwrite: Any, micro: Batch) -> Any:
            applied = module.apply(
                {"params": params, **({OVERWRITE: overwrite} if overwrite else {}), **persistent},
                micro.tokens,
                micro.positions,
                micro.segment_ids,
                rngs=rngs,
                mutable=["intermediates"] if self.aux_names else False,
                **self.train_kwargs,
                **(loss_inputs(micro, predicts) if self.tiled else {}),
            )
            outputs, sown = applied if self.aux_names else (applied, {})
            aux = sown_losses(sown.get("intermediates", {}), self.aux_names)
            return with_aux(objective(outputs, micro), aux, cross_entropy)

        return loss_fn

    def step(
        self, state: dict[str, Any], batch: Batch, micro_sharding: NamedSharding | None = None
    ) -> Any:
        """One train step ``(state, batch) -> (next state, metrics)``, unjitted (see step_fn)."""
        opt = state["optimizer"]
        params, overwrite, persistent = self._split(state["model"])
        loss_fn = self._loss_fn(self._streams(opt["step"]), persistent)
        grad_fn = functools.partial(
            jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True), params, overwrite
        )
        (loss_sum, (count, aux)), (grads, overwritten) = self.accumulate(
            grad_fn, batch, self.micro_batches, micro_sharding
        )
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = self.tx.update(grads, opt["opt_state"], params)
        model = optax.apply_updates(params, updates)
        if self.kept:
            kept = [flatten(overwritten), *(flatten(tree) for tree in persistent.values())]
            model = unflatten({k: v for flat in (flatten(model), *kept) for k, v in flat.items()})
        new_state = {
            "model": model,
            "optimizer": {"opt_state": opt_state, "step": opt["step"] + 1},
        }
        return new_state, metrics(loss_sum / count, grads, aux)

    def _step_around(self, around: Around) -> Callable[..., Any]:
        """:meth:`step` traced inside :func:`~conformance.runtime.calls.linen_calls`."""

        def step(state: dict[str, Any], batch: Batch, micro_sharding: Any = None) -> Any:
            with linen_calls(around):
                return self.step(state, batch, micro_sharding)

        return step

    def aux_gradient(self, state: dict[str, Any], batch: Batch) -> Any:
        """The gradient of the declared auxiliary losses alone, from ``state``'s parameters.

        :meth:`step`'s own objective (same forward, RNG streams and loss path) with the
        cross entropy left out, for the sum of what the forward sows under
        :class:`~conformance.contract.AuxLosses`; unjitted.
        """
        params, overwrite, persistent = self._split(state["model"])
        streams = self._streams(state["optimizer"]["step"])
        loss_fn = self._loss_fn(streams, persistent, cross_entropy=False)
        (_, (count, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, overwrite, batch)
        return jax.tree.map(lambda g: g / count, grads)


def nnx_training_forward(
    model: nnx.Module, batch: Batch, train_kwargs: Mapping[str, Any]
) -> tuple[jax.Array, Any]:
    """Training-mode logits and what the forward sowed: captured, never stored on the model."""
    return nnx.capture(model, nnx.Intermediate)(
        batch.tokens, batch.positions, batch.segment_ids, **train_kwargs
    )


class NnxTrainer(TrainerBase):
    """NNX train state (model + optimizer) and its step, for one family config.

    Beside the loss and accumulation, its forward and train-state class are the seams
    ``nnx_training_forward`` and ``nnx_train_state`` (:mod:`conformance.core.seams`),
    read when the trainer is built.
    """

    backend = Backend.NNX

    def __init__(
        self,
        family: Family,
        config: Any,
        micro_batches: int = 1,
        quant: str | None = None,
        vocab_tiles: int = 1,
    ) -> None:
        super().__init__(family, config, micro_batches, vocab_tiles)
        self.runner = nnx_runner(family, self.config, quant)
        self.forward = seam("nnx_training_forward", nnx_training_forward)
        self.train_state = seam("nnx_train_state", NnxTrainState)
        abstract = nnx.eval_shape(lambda: self.train_state(self.runner.build(0), self.tx))
        self.graphdef, self.abstract_streams, self.abstract_state = nnx.split(
            abstract, nnx.RngState, ...
        )
        self._vars = flatten_state(self.abstract_state)
        self.overwrite = any(isinstance(v, OverwriteWithGradient) for v in self._vars.values())
        """Whether the model holds :data:`OVERWRITE` Variables (kept in the state's model)."""
        refuse_accumulated_overwrite(self.overwrite, micro_batches)
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(self.abstract_state)}
        self.logical: dict[str, Logical] = nnx_logical(self.abstract_state)
        self._create = jax.jit(self._create_impl)

    @property
    def kinds(self) -> dict[str, str]:
        """What each train-state leaf is, by path (see :func:`state_kind`)."""
        return {path: state_kind(var) for path, var in self._vars.items()}

    def initial_state(self, params: Flat) -> nnx.State:
        """A train state around ``params``: fresh optimizer state, step 0."""
        rest = self.runner.rest(mesh_of(params))
        return self._create(self.runner.pack(params), rest)

    def _create_impl(self, params: nnx.State, rest: nnx.State) -> nnx.State:
        model = nnx.merge(self.runner.graphdef, params, rest)
        return nnx.state(self.train_state(model, self.tx), nnx.Not(nnx.RngState))

    def tree(self, by_path: Mapping[str, Any]) -> nnx.State:
        """The train state's ``nnx.State`` holding ``by_path``'s arrays or shardings."""
        return nnx.from_flat_state(
            [(self._keys[p], var.replace(by_path[p])) for p, var in self._vars.items()]
        )

    def abstract(self, shardings: Mapping[str, NamedSharding]) -> nnx.State:
        """The train state as ``jax.ShapeDtypeStruct`` leaves with ``shardings`` (by path).

        What a step lowers for a mesh without allocating anything.
        """
        return self.tree(
            {p: _abstract(var.get_value(), shardings[p]) for p, var in self._vars.items()}
        )

    def _train(self, state: nnx.State) -> Any:
        """The train-state module around ``state``, with the RNG streams of its step."""
        streams = step_streams(self.abstract_streams, state["optimizer"]["step"][...])
        return nnx.merge(self.graphdef, streams, state)

    def _loss_fn(self, cross_entropy: bool = True) -> Any:
        """``(model, micro) -> (value, (count, aux))``: what a step differentiates.

        Without ``cross_entropy`` the value is the auxiliary losses' part alone.
        """
        objective = objective_of(self.loss, self.tiled, self.overwrite, self.predicts)

        def loss_fn(model: nnx.Module, micro: Batch) -> Any:
            tiling = loss_inputs(micro, self.predicts) if self.tiled else {}
            outputs, sown = self.forward(model, micro, {**self.train_kwargs, **tiling})
            aux = sown_losses(sown, self.aux_names)
            return with_aux(objective(outputs, micro), aux, cross_entropy)

        return loss_fn

    def step(
        self, state: nnx.State, batch: Batch, micro_sharding: NamedSharding | None = None
    ) -> Any:
        """One train step ``(state, batch) -> (next state, metrics)``, unjitted (see step_fn)."""
        train = self._train(state)
        wrt = nnx.Any(nnx.Param, OverwriteWithGradient) if self.overwrite else nnx.Param
        grad_fn = _differentiated(self._loss_fn(), wrt)
        (loss_sum, (count, aux)), grads = self.accumulate(
            lambda micro: grad_fn(train.model, micro), batch, self.micro_batches, micro_sharding
        )
        if self.overwrite:
            grads, overwritten = nnx.split_state(grads, nnx.Param, OverwriteWithGradient)
            nnx.update(train.model, overwritten)
        grads = jax.tree.map(lambda g: g / count, grads)
        train.optimizer.update(train.model, grads)
        return nnx.state(train, nnx.Not(nnx.RngState)), metrics(loss_sum / count, grads, aux)

    def _step_around(self, around: Around) -> Callable[..., Any]:
        """:meth:`step` of a copy of this trainer, its forward inside ``nnx_calls``.

        The training forward of the copy runs the model inside
        :func:`~conformance.runtime.calls.nnx_calls`; this trainer is left as it was.
        """
        forward = self.forward

        def routed(model: nnx.Module, batch: Batch, train_kwargs: Mapping[str, Any]) -> Any:
            with nnx_calls(model, around):
                return forward(model, batch, train_kwargs)

        probed = copy.copy(self)
        probed.forward = routed
        return probed.step

    def aux_gradient(self, state: nnx.State, batch: Batch) -> Any:
        """The gradient of the declared auxiliary losses alone, from ``state``'s parameters.

        :meth:`step`'s own objective (the same seams, RNG streams and loss path) with the
        cross entropy left out, for the sum of what the forward sows under
        :class:`~conformance.contract.AuxLosses`; unjitted.
        """
        grad_fn = _differentiated(self._loss_fn(cross_entropy=False), nnx.Param)
        (_, (count, _)), grads = grad_fn(self._train(state).model, batch)
        return jax.tree.map(lambda g: g / count, grads)


@scoped
def linen_trainer(
    family: Family,
    config: Any,
    micro_batches: int = 1,
    quant: str | None = None,
    vocab_tiles: int = 1,
) -> LinenTrainer:
    """The Linen trainer for ``(family, config, micro_batches, quant, vocab_tiles)``."""
    return LinenTrainer(family, config, micro_batches, quant, vocab_tiles)


@scoped
def nnx_trainer(
    family: Family,
    config: Any,
    micro_batches: int = 1,
    quant: str | None = None,
    vocab_tiles: int = 1,
) -> NnxTrainer:
    """The NNX trainer for ``(family, config, micro_batches, quant, vocab_tiles)``."""
    return NnxTrainer(family, config, micro_batches, quant, vocab_tiles)


TRAINERS: dict[Backend, Callable[..., Any]] = {
    Backend.LINEN: linen_trainer,
    Backend.NNX: nnx_trainer,
}
"""Each backend's trainer factory, by backend id."""
