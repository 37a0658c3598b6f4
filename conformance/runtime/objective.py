"""What a train step computes and differentiates: the loss, its auxiliary terms, micro-batches.

The loss is cross entropy against the batch's targets where they are real (by segment
id, for what the family's logits predict; no token value is taken for padding),
optimised with AdamW under a warmup-cosine schedule after global-norm clipping. With
more than one micro-batch the batch is split along its first axis, and summed losses,
token counts and gradients are accumulated before one update, so the result equals a
step on the whole batch. A vocab-tiled model computes its loss itself, and the step
differentiates its mean. Both backends' trainers (:mod:`conformance.runtime.training`)
use these functions, so the two sides' objectives are one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from conformance.contract import Batch
from conformance.core.sharding import explicit_mode
from conformance.core.trees import flatten
from conformance.runtime.backends import OVERWRITE

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


def laid_out_as_targets(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``logits`` laid out as ``targets`` with their class axis whole, in explicit mode.

    Picking each target's logit is a gather whose result's sharding jax cannot infer
    from logits split over their classes, or split otherwise than the targets (the
    cotangent would come back in another type than the logits have). Outside explicit
    mode: ``logits`` as they are.
    """
    if not explicit_mode():
        return logits
    rows = tuple(jax.typeof(targets).sharding.spec)
    rows += (None,) * (targets.ndim - len(rows))
    return jax.sharding.reshard(logits, PartitionSpec(*rows, None))


def masked_token_loss(
    logits: jax.Array, batch: Batch, predicts: str = "next"
) -> tuple[jax.Array, jax.Array]:
    """Summed cross entropy against the batch's targets where they are real, and how many were.

    ``predicts`` is the family's :attr:`~conformance.contract.Family.logits_predict`.
    """
    weights = target_weights(batch, predicts)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        laid_out_as_targets(logits.astype(jnp.float32), batch.targets), batch.targets
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


def objective_of(loss: LossFn, tiled: bool, overwrite: bool, predicts: str) -> LossFn:
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


def refuse_accumulated_overwrite(overwrite: bool, micro_batches: int) -> None:
    """Refuse micro-batches for a model with :data:`OVERWRITE` values.

    Their gradient is the next value, not an increment: summed over micro-batches it
    means nothing (MaxText rejects FP8 with gradient accumulation for this reason).
    """
    if overwrite and micro_batches != 1:
        raise ValueError(
            f"a model with {OVERWRITE} variables (FP8 scales and amax histories) "
            "cannot accumulate gradients over micro-batches"
        )
