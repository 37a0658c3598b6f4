"""Train states and jitted, sharded train steps for both backends.

Both sides keep a persistent train state with the same canonical paths:
``model/<param path>``, ``optimizer/opt_state/<optax path>/<param path>`` and
``optimizer/step``. A step maps ``(state, batch)`` to ``(next state, metrics)`` with
metrics ``loss`` and per-leaf ``grads``, jitted with explicit in and out shardings.

The loss is cross entropy against the batch's targets where they are real (by segment
id, for what the family's logits predict; no token value is taken for padding),
optimised with AdamW under a warmup-cosine schedule after global-norm clipping. With
``micro_batches > 1`` the batch is split along its first axis, and summed losses, token
counts and gradients are accumulated before one update, so the result equals a step on
the whole batch. With ``vocab_tiles > 1`` the family's
:meth:`~conformance.contract.Family.vocab_tiling_config` computes the loss inside the
model, and the step differentiates its mean.

NNX models keep their RNG streams (``nnx.RngState``: a key and a counter per stream) as
variables; Linen takes them per call. The NNX train state leaves them out, so both train
states hold the same leaves: each step draws fresh streams from its step counter, as the
Linen step folds the step into a key per stream of ``Family.train_rngs``, and a
checkpoint holds no RNG streams on either side. :func:`conformance.checks.structure.check_structure`
lists the streams it set aside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import NamedSharding, PartitionSpec

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

STREAMS_SEED = 0
"""Seed of the RNG streams a train step draws (folded with the step counter)."""

LossFn = Callable[[jax.Array, Batch], tuple[jax.Array, jax.Array]]
GradFn = Callable[[Batch], tuple[tuple[jax.Array, jax.Array], Any]]


def make_optimizer() -> optax.GradientTransformation:
    """AdamW, warmup-cosine learning rate, global-norm clipping: the same on both sides."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=1e-4, peak_value=1e-3, warmup_steps=2, decay_steps=10
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def target_weights(batch: Batch, predicts: str = "next") -> jax.Array:
    """1.0 where a target is real, else 0.0.

    A target is real when the token the logits predict is: for ``predicts="next"``
    (:attr:`~conformance.contract.Family.logits_predict`) the position and the next are
    real tokens; for ``"current"`` the position is.
    """
    real = batch.segment_ids != 0
    if predicts == "current":
        return real.astype(jnp.float32)
    follows = jnp.zeros_like(real).at[:, :-1].set(real[:, 1:])
    return (real & follows).astype(jnp.float32)


def masked_token_loss(
    logits: jax.Array, batch: Batch, predicts: str = "next"
) -> tuple[jax.Array, jax.Array]:
    """Summed cross entropy against the batch's targets where they are real, and how many were.

    ``predicts`` is the family's :attr:`~conformance.contract.Family.logits_predict`.
    """
    weights = target_weights(batch, predicts)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch.targets
    )
    return jnp.sum(losses * weights), jnp.sum(weights)


@functools.partial(jax.jit, static_argnames="predicts")
def mean_token_loss(logits: jax.Array, batch: Batch, predicts: str = "next") -> jax.Array:
    """:func:`masked_token_loss`'s mean over the real targets, as one compiled program.

    For checks that compute a loss outside a train step: run op by op on sharded logits,
    the loss would compile a program per operation, again in every scope.
    """
    loss_sum, count = masked_token_loss(logits, batch, predicts)
    return loss_sum / count


def loss_inputs(batch: Batch, predicts: str = "next") -> dict[str, jax.Array]:
    """The keywords a vocab-tiled module computes its own loss from."""
    return {"targets": batch.targets, "target_weights": target_weights(batch, predicts)}


def model_loss(
    loss_sum: jax.Array, batch: Batch, predicts: str = "next"
) -> tuple[jax.Array, jax.Array]:
    """A vocab-tiled module's own summed loss, and how many targets were real."""
    return loss_sum.astype(jnp.float32), jnp.sum(target_weights(batch, predicts))


OverwriteWithGradient = variablelib.variable_type_from_name(OVERWRITE, allow_register=True)
"""The NNX Variable type of :data:`OVERWRITE` (what ``nnx.bridge`` makes of the collection)."""


def _objective(loss: LossFn, tiled: bool, overwrite: bool, predicts: str) -> LossFn:
    """What a step differentiates: ``loss`` summed with its count, or a mean counted as 1.

    A vocab-tiled model computes its loss itself (:func:`model_loss` replaces ``loss``).
    A step differentiates the mean when the model's gradients depend on the cotangent
    it receives: a vocab-tiled loss's hand-written backward, or FP8's output-gradient
    amax history (``overwrite``). Otherwise it differentiates the sum and divides the
    gradients by the count, which lets micro-batches accumulate.
    """
    if tiled:
        loss = functools.partial(model_loss, predicts=predicts)
    if not (tiled or overwrite):
        return loss

    def mean_loss(outputs: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        total, count = loss(outputs, batch)
        return total / count, jnp.ones((), jnp.float32)

    return mean_loss


def metrics(loss: jax.Array, grads: Any, aux: Mapping[str, jax.Array]) -> dict[str, Any]:
    """A step's metrics: the mean ``loss``, the ``grads`` and any auxiliary losses.

    ``loss`` includes the auxiliary losses; ``aux`` (only for a family that declares
    them) holds each, summed over micro-batches.
    """
    return {"loss": loss, "grads": grads, **({"aux": dict(aux)} if aux else {})}


def _tiled(family: Family, config: Any, micro_batches: int, vocab_tiles: int) -> Any:
    """``config`` with the family's vocab tiling, or unchanged for one tile."""
    if vocab_tiles == 1:
        return config
    if micro_batches != 1:
        raise ValueError("a vocab-tiled step takes the whole batch (one micro-batch)")
    return family.vocab_tiling_config(config, vocab_tiles)


def split_batch(batch: Batch, micro_batches: int) -> list[Batch]:
    """``batch`` cut into ``micro_batches`` equal slices along the batch axis."""
    rows = batch.tokens.shape[0]
    if rows % micro_batches:
        raise ValueError(f"{rows} rows do not split into {micro_batches} micro-batches")
    size = rows // micro_batches
    return [
        jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch)
        for i in range(micro_batches)
    ]


def accumulate(
    grad_fn: GradFn, batch: Batch, micro_batches: int, sharding: NamedSharding | None = None
) -> Any:
    """Sum ``grad_fn``'s ``((loss_sum, count), grads)`` over the micro-batches of ``batch``.

    With ``sharding``, each micro-batch is constrained to it first. The harness passes a
    replicated sharding: on the CPU, XLA's SPMD partitioner (jaxlib 0.12.0.1) computes a
    wrong gradient for a gather over a slice of a batch sharded over several mesh axes
    (see ``tests/test_upstream.py``).
    """
    outputs = []
    for micro in split_batch(batch, micro_batches):
        if sharding is not None and micro_batches > 1:
            micro = jax.lax.with_sharding_constraint(micro, sharding)
        outputs.append(grad_fn(micro))
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outputs)


def _abstract(leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """``leaf``'s shape and dtype with ``sharding``: an argument nothing is allocated for."""
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _step_fns(cache: dict[Any, Any], step: Callable[..., Any], shardings: Any) -> Any:
    """Jit ``step(state, batch, micro_sharding=...)`` once per state sharding."""
    leaves = None if shardings is None else tuple(jax.tree.leaves(shardings))
    if leaves not in cache:
        in_sh = out_sh = micro = None
        if leaves is not None:
            in_sh, out_sh = (shardings, None), (shardings, None)
            micro = replicated(leaves[0].mesh)
        bound = functools.partial(step, micro_sharding=micro)
        cache[leaves] = jax.jit(bound, in_shardings=in_sh, out_shardings=out_sh)
    return cache[leaves]


class LinenTrainer:
    """Linen train state (a nested dict) and its step, for one family config."""

    def __init__(
        self,
        family: Family,
        config: Any,
        micro_batches: int = 1,
        quant: str | None = None,
        vocab_tiles: int = 1,
    ) -> None:
        config = _tiled(family, config, micro_batches, vocab_tiles)
        self.runner = linen_runner(family, config, quant)
        self.aux_names = family.capabilities.aux_losses
        self.train_kwargs = dict(family.train_kwargs(config))
        self.tiled = vocab_tiles > 1
        self.kept = {
            path: collection for collection, leaves in self.runner.kept.items() for path in leaves
        }
        """The collection of each value the state's ``model`` keeps beside params, by
        path: :data:`OVERWRITE` values and the family's persistent state."""
        self._kinds = {OVERWRITE: OVERWRITE, **persistent_collections(family)}
        """Each kept collection's kind in :attr:`kinds`: persistent state by its type's name."""
        self.overwrite = {path for path, c in self.kept.items() if c == OVERWRITE}
        """Paths of :data:`OVERWRITE` values (a step replaces them with their gradient)."""
        _check_overwrite(bool(self.overwrite), micro_batches)
        self.streams = family.train_rngs
        self.micro_batches = micro_batches
        self.tx = make_optimizer()
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
        self._steps: dict[Any, Any] = {}
        self._create = jax.jit(self._create_impl)
        self.aux_gradient_fn = jax.jit(self.aux_gradient)
        """The jitted :meth:`aux_gradient`, traced once per trainer."""

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
        predicts = self.runner.family.logits_predict
        objective = _objective(
            functools.partial(masked_token_loss, predicts=predicts),
            self.tiled,
            bool(self.overwrite),
            predicts,
        )

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
        (loss_sum, (count, aux)), (grads, overwritten) = accumulate(
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

    def aux_gradient(self, state: dict[str, Any], batch: Batch) -> Any:
        """The gradient of the declared auxiliary losses alone, from ``state``'s parameters.

        :meth:`step`'s own objective (same forward, RNG streams and loss path) with the
        cross entropy left out, for the sum of what the forward sows under
        :attr:`~conformance.contract.Capabilities.aux_losses`; unjitted.
        """
        params, overwrite, persistent = self._split(state["model"])
        streams = self._streams(state["optimizer"]["step"])
        loss_fn = self._loss_fn(streams, persistent, cross_entropy=False)
        (_, (count, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, overwrite, batch)
        return jax.tree.map(lambda g: g / count, grads)

    def step_fn(self, shardings: Any = None) -> Any:
        """The jitted ``(state, batch) -> (state, metrics)``, cached per sharding."""
        return _step_fns(self._steps, self.step, shardings)


def step_streams(abstract: nnx.State, step: jax.Array) -> nnx.State:
    """RNG streams for ``step`` shaped like ``abstract``: fresh keys, counters at zero.

    Each key leaf gets its own key, a function of its position and ``step`` only, so a
    step is deterministic and successive steps draw different dropout masks.
    """
    leaves, treedef = jax.tree.flatten(abstract)
    base = jax.random.fold_in(jax.random.key(STREAMS_SEED), step)
    streams = []
    for index, leaf in enumerate(leaves):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key = jax.random.fold_in(base, index)
            streams.append(jax.random.split(key, leaf.shape) if leaf.shape else key)
        else:
            streams.append(jnp.zeros(leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, streams)


class NnxTrainState(nnx.Module):
    """The NNX train state: the model and its optimizer, split and merged as one."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation) -> None:
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


def nnx_training_forward(
    model: nnx.Module, batch: Batch, train_kwargs: Mapping[str, Any]
) -> tuple[jax.Array, Any]:
    """Training-mode logits and what the forward sowed: captured, never stored on the model."""
    return nnx.capture(model, nnx.Intermediate)(
        batch.tokens, batch.positions, batch.segment_ids, **train_kwargs
    )


def sown_losses(sown: Any, names: Sequence[str]) -> dict[str, jax.Array]:
    """``{name: float32 sum of every value sown under name}`` for the ``names`` found.

    ``sown`` is a Linen ``intermediates`` collection or a captured NNX state.
    """
    found: dict[str, jax.Array] = {}
    for path, value in flatten(sown).items():
        for name in set(names) & set(path.split("/")):
            total = jnp.sum(jnp.asarray(value, jnp.float32))
            found[name] = found[name] + total if name in found else total
    return found


def aux_total(aux: Mapping[str, jax.Array]) -> Any:
    """The sum of the auxiliary losses ``aux`` (0 when there are none)."""
    return sum(aux.values())


def with_aux(
    objective: tuple[jax.Array, jax.Array],
    aux: Mapping[str, jax.Array],
    cross_entropy: bool = True,
) -> tuple[jax.Array, tuple[jax.Array, Mapping[str, jax.Array]]]:
    """The value a micro-batch differentiates, with ``(count, aux)`` carried beside it.

    The loss sum plus every auxiliary loss weighted by the target count, so that the mean
    loss gains each once; the loss sum itself when there are none. Without
    ``cross_entropy`` the loss sum is left out: what remains is the auxiliary part alone.
    """
    loss_sum, count = objective
    total = loss_sum if cross_entropy else jnp.zeros_like(loss_sum)
    if aux:
        total = total + aux_total(aux) * count
    return total, (count, dict(aux))


class NnxTrainer:
    """NNX train state (model + optimizer) and its step, for one family config.

    Its forward, loss, accumulation and train-state class are the seams
    ``nnx_training_forward``, ``nnx_loss``, ``nnx_accumulate`` and ``nnx_train_state``
    (:mod:`conformance.core.seams`), read when the trainer is built.
    """

    def __init__(
        self,
        family: Family,
        config: Any,
        micro_batches: int = 1,
        quant: str | None = None,
        vocab_tiles: int = 1,
    ) -> None:
        config = _tiled(family, config, micro_batches, vocab_tiles)
        self.runner = nnx_runner(family, config, quant)
        self.train_kwargs = dict(family.train_kwargs(config))
        self.tiled = vocab_tiles > 1
        self.micro_batches = micro_batches
        self.tx = make_optimizer()
        self.forward = seam("nnx_training_forward", nnx_training_forward)
        self.predicts = family.logits_predict
        self.aux_names = family.capabilities.aux_losses
        self.loss = seam("nnx_loss", functools.partial(masked_token_loss, predicts=self.predicts))
        self.accumulate = seam("nnx_accumulate", accumulate)
        self.train_state = seam("nnx_train_state", NnxTrainState)
        abstract = nnx.eval_shape(lambda: self.train_state(self.runner.build(0), self.tx))
        self.graphdef, self.abstract_streams, self.abstract_state = nnx.split(
            abstract, nnx.RngState, ...
        )
        self._vars = flatten_state(self.abstract_state)
        self.overwrite = any(isinstance(v, OverwriteWithGradient) for v in self._vars.values())
        """Whether the model holds :data:`OVERWRITE` Variables (kept in the state's model)."""
        _check_overwrite(self.overwrite, micro_batches)
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(self.abstract_state)}
        self.logical: dict[str, Logical] = nnx_logical(self.abstract_state)
        self._steps: dict[Any, Any] = {}
        self._create = jax.jit(self._create_impl)
        self.aux_gradient_fn = jax.jit(self.aux_gradient)
        """The jitted :meth:`aux_gradient`, traced once per trainer."""

    @property
    def kinds(self) -> dict[str, str]:
        """What each train-state leaf is, by path (see :func:`state_kind`)."""
        return {path: state_kind(var) for path, var in self._vars.items()}

    def initial_state(self, params: Flat) -> nnx.State:
        """A train state around ``params``: fresh optimizer state, step 0."""
        rest = self.runner.rest(mesh_of(params))
        return self._create(self.runner.state(params), rest)

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
        objective = _objective(self.loss, self.tiled, self.overwrite, self.predicts)

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
        grad_fn = nnx.value_and_grad(self._loss_fn(), argnums=nnx.DiffState(0, wrt), has_aux=True)
        (loss_sum, (count, aux)), grads = self.accumulate(
            lambda micro: grad_fn(train.model, micro), batch, self.micro_batches, micro_sharding
        )
        if self.overwrite:
            grads, overwritten = nnx.split_state(grads, nnx.Param, OverwriteWithGradient)
            nnx.update(train.model, overwritten)
        grads = jax.tree.map(lambda g: g / count, grads)
        train.optimizer.update(train.model, grads)
        return nnx.state(train, nnx.Not(nnx.RngState)), metrics(loss_sum / count, grads, aux)

    def aux_gradient(self, state: nnx.State, batch: Batch) -> Any:
        """The gradient of the declared auxiliary losses alone, from ``state``'s parameters.

        :meth:`step`'s own objective (the same seams, RNG streams and loss path) with the
        cross entropy left out, for the sum of what the forward sows under
        :attr:`~conformance.contract.Capabilities.aux_losses`; unjitted.
        """
        grad_fn = nnx.value_and_grad(
            self._loss_fn(cross_entropy=False),
            argnums=nnx.DiffState(0, nnx.Param),
            has_aux=True,
        )
        (_, (count, _)), grads = grad_fn(self._train(state).model, batch)
        return jax.tree.map(lambda g: g / count, grads)

    def step_fn(self, shardings: Any = None) -> Any:
        """The jitted ``(state, batch) -> (state, metrics)``, cached per sharding."""
        return _step_fns(self._steps, self.step, shardings)


def _check_overwrite(overwrite: bool, micro_batches: int) -> None:
    """Refuse micro-batches for a model with :data:`OVERWRITE` values.

    Their gradient is the next value, not an increment: summed over micro-batches it
    means nothing (MaxText rejects FP8 with gradient accumulation for this reason).
    """
    if overwrite and micro_batches != 1:
        raise ValueError(
            f"a model with {OVERWRITE} variables (FP8 scales and amax histories) "
            "cannot accumulate gradients over micro-batches"
        )


def state_kind(var: nnx.Variable) -> str:
    """A train-state leaf's kind, named alike on both backends.

    ``Param`` (Linen's ``params`` collection), ``OptState`` (optimizer state, the step
    counter included), :data:`OVERWRITE` (FP8 scales and amax histories), or the Variable
    type's own name for anything else (``MoEBiasVar``): a leaf that changes kind between
    releases has changed collection.
    """
    for kind in (OverwriteWithGradient, nnx.Param, nnx.OptState):
        if isinstance(var, kind):
            return OVERWRITE if kind is OverwriteWithGradient else kind.__name__
    return type(var).__name__


def flat_state(state: Any) -> Flat:
    """A train state or gradient tree (Linen dicts or NNX State) as ``{path: array}``."""
    if isinstance(state, nnx.State):
        return {p: v.get_value() for p, v in flatten_state(state).items()}
    return flatten(state)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


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
