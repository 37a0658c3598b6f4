"""Faults in training: the state, the step, accumulation, tiling, FP8, partitioning."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from conformance.runtime.objective import split_batch
from conformance.runtime.train_state import NnxTrainState
from conformance_models import common
from conformance_models.config import TransformerConfig
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from conformance_models.moe import nnx_model as moe_nnx
from conformance_models.moe import routing
from tests.faults.fault import Fault, Llama, Moe


class StrayCounterBesideRngs(Gpt3Family):
    """NNX carries dropout RNG streams, which train states set aside, and a stray counter.

    Proves the RNG normalisation hides nothing else: the counter must still be reported.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(dataclasses.replace(config, dropout_rate=0.1), rngs)
        model.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
        return model


class Fp8DroppedInOneProjection(LlamaFamily):
    """NNX block 0's MLP up projection computes in float32 under an FP8 config.

    It keeps its FP8 scales and amax histories, which then never see a value.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.up.fp8 = False
        return model


class NnxIgnoresDropout(Gpt3Family):
    """NNX builds its model without dropout whatever the config asks (a rate not passed on)."""

    def nnx_module(self, config, rngs):
        return super().nnx_module(dataclasses.replace(config, dropout_rate=0.0), rngs)


class NnxRematInBfloat16(LlamaFamily):
    """NNX computes in bfloat16 under ``remat`` (a policy that keeps activations in bf16)."""

    def nnx_module(self, config, rngs):
        if config.remat:
            config = dataclasses.replace(config, dtype=jnp.bfloat16)
        return super().nnx_module(config, rngs)


@dataclasses.dataclass(frozen=True)
class _MeshedConfig(TransformerConfig):
    """A built-in config that also carries the device mesh (``Family.with_mesh``)."""

    mesh: Any = None


class _RowParallelDownWrongAxis(llama_nnx.Mlp):
    """A hand-written row-parallel down projection whose partial sums meet over "data"."""

    mesh: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(self.gate(x)) * self.up(x)

        def partial_products(h: jax.Array, kernel: jax.Array) -> jax.Array:
            return jax.lax.psum(h @ kernel, "data")  # the fault: the sum belongs on "tensor"

        return jax.shard_map(
            partial_products,
            mesh=self.mesh,
            in_specs=(P(None, None, "tensor"), P("tensor", None)),
            out_specs=P(),
            check_vma=False,
        )(hidden, self.down.kernel[...])


class PsumOverWrongAxis(LlamaFamily):
    """NNX block 0's MLP sums its row-parallel partial products over the wrong mesh axis.

    On one device every axis has size 1 and the result is right; on ``data=2,fsdp=2,
    tensor=2`` half of the products are dropped and the other half doubled. Only a
    partitioned run shows it: the fault of ``sharding_invariance``, and the partitioning
    problem that cross-backend reports must not blame on Linen or NNX.
    """

    def config(self, size, *, scan_layers, dtype=jnp.float32):
        base = super().config(size, scan_layers=scan_layers, dtype=dtype)
        return _MeshedConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def with_mesh(self, config, mesh):
        return dataclasses.replace(config, mesh=mesh)

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.mesh is not None:
            mlp = model.layers[0].mlp
            mlp.__class__ = _RowParallelDownWrongAxis
            mlp.mesh = config.mesh
        return model


def forward_without_capture(model, batch, train_kwargs):
    """The NNX training forward called directly: its sown ``hidden_states`` stay on the model."""
    return model(batch.tokens, batch.positions, batch.segment_ids, **train_kwargs), {}


def forward_popping_intermediates(model, batch, train_kwargs):
    """The NNX training forward, then a generic ``nnx.pop`` of every sown intermediate.

    The pop runs before the loss reads them, so a sown auxiliary loss silently drops out
    of the loss (MaxText's multi-token-prediction loss became 0 this way).
    """
    logits = model(batch.tokens, batch.positions, batch.segment_ids, **train_kwargs)
    nnx.pop(model, nnx.Intermediate)
    return logits, {}


def _detached_load_balancing(self, x):
    """NNX MoE MLP that sows its load-balancing loss detached: right value, no gradient."""
    probs = routing.router_probabilities(self.router(x))
    loss = routing.load_balancing_loss(probs, self.config.lb_weight)
    self.sow(nnx.Intermediate, routing.AUX_LOSS, jax.lax.stop_gradient(loss))
    kernels = (self.wi_gate[...], self.wi_up[...], self.wo[...])
    return routing.mix_experts(x, probs, *kernels, self.config.dtype)


def drop_last_micro_batch(grad_fn, batch, micro_batches, sharding=None):
    """``accumulate`` that forgets the last micro-batch when there is more than one."""
    micros = split_batch(batch, micro_batches)
    micros = micros[:-1] if len(micros) > 1 else micros
    outputs = [grad_fn(m) for m in micros]
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outputs)


def unmasked_loss(logits, batch):
    """``masked_token_loss`` that counts padding and each row's last target too."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch.targets
    )
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


_tiled_token_loss = common.tiled_token_loss


def _tiled_loss_detached(head, hidden, targets, weights, tiles):
    """``tiled_token_loss`` whose slices stop the gradient: the decoder learns nothing."""
    return _tiled_token_loss(head, jax.lax.stop_gradient(hidden), targets, weights, tiles)


class MoeLossWeightedOff(Moe):
    """moe whose load-balancing loss weight is 0, as MaxText's ``base.yml`` ships it, and
    whose ``aux_losses_config`` does not turn it on: the loss is sown, and it is 0."""

    def config(self, size: str, *, scan_layers: bool, dtype: Any = jnp.float32) -> Any:
        base = super().config(size, scan_layers=scan_layers, dtype=dtype)
        return dataclasses.replace(base, lb_weight=0.0)


class ReshardedTrainState(NnxTrainState):
    """NNX optimizer state whose mu for block 0's MLP up kernel is annotated on swapped axes."""

    def __init__(self, model, tx):
        super().__init__(model, tx)
        for path, node in nnx.iter_graph(self.optimizer):
            if path[-6:] == ("mu", "layers", 0, "mlp", "up", "kernel"):
                node.set_metadata(out_sharding=("mlp", "embed"))


FAULTS = (
    Fault(
        NnxIgnoresDropout(),
        "dropout",
        ("NNX training loss with dropout 0.1 equals the deterministic loss within float32",),
    ),
    Fault(
        NnxRematInBfloat16(),
        "layout",
        ("NNX one step on mesh", "grads/layers/0/attn/k/kernel: ", "remat="),
        params={"variant": "remat"},
    ),
    Fault(
        StrayCounterBesideRngs(),
        "hygiene",
        ("NNX train step", "model/calls: flax.nnx.variablelib.BatchStat is not persistent state"),
    ),
    Fault(
        Llama(),
        "hygiene",
        (
            "NNX train step",
            "model/hidden_states: its output has it",
            "model/hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate) "
            "is not persistent state",
        ),
        seams={"nnx_training_forward": forward_without_capture},
    ),
    Fault(
        Moe(),
        "aux_losses",
        ("moe_lb_loss: NNX's train step added nothing to its loss",),
        seams={"nnx_training_forward": forward_popping_intermediates},
    ),
    Fault(
        Moe(),
        "aux_losses",
        ("NNX: the auxiliary losses (moe_lb_loss) have no gradient",),
        model_patch=(moe_nnx.MoeMlp, "__call__", _detached_load_balancing),
    ),
    Fault(
        MoeLossWeightedOff(),
        "aux_losses",
        ("moe_lb_loss: Linen's train step added exactly 0 to its loss",),
    ),
    # Dropping NNX's last micro-batch is planted in bfloat16 (below), Linen's in float32.
    Fault(
        Llama(),
        "grad_accumulation",
        ("Linen one step", "loss:"),
        seams={"linen_accumulate": drop_last_micro_batch},
    ),
    Fault(
        Llama(),
        "grad_accumulation",
        (
            "NNX one step on mesh data2-fsdp2-tensor2",
            "grads/token_embed/embedding: ",
            "the float32 steps disagree too",
            "a divergence the lower precision carries, not rounding",
        ),
        seams={"nnx_accumulate": drop_last_micro_batch},
        dtype=jnp.bfloat16,
    ),
    Fault(
        Llama(),
        "train_step",
        (
            "step 1 of 3",
            "loss:",
            "verdict: a Linen/NNX divergence: it shows on one device too, and partitioning "
            "changes neither side",
        ),
        seams={"nnx_loss": unmasked_loss},
    ),
    Fault(
        Llama(),
        "train_step",
        ("step 1 of 3", "loss:", "verdict: a Linen/NNX divergence: it shows on one device too"),
        seams={"linen_loss": unmasked_loss},
    ),
    Fault(
        Llama(),
        "vocab_tiling",
        ("Linen one step on mesh", "untiled", "4 vocab tiles", "grads/layers/0/"),
        model_patch=(common, "tiled_token_loss", _tiled_loss_detached),
    ),
    Fault(
        Fp8DroppedInOneProjection(),
        "fp8_train_step",
        (
            "step 1 of 3",
            "state/model/layers/0/mlp/up/Fp8DirectDotGeneralOp_0/input_amax_history:",
        ),
    ),
    Fault(
        PsumOverWrongAxis(),
        "sharding_invariance",
        (
            "NNX on mesh data2-fsdp2-tensor2 against NNX on one device",
            "grads/layers/0/mlp/down/kernel: ",
            "NNX computes differently when partitioned on mesh data2-fsdp2-tensor2",
        ),
        params={"backend": "nnx"},
        mesh_axes=("data", "tensor"),
    ),
    Fault(
        PsumOverWrongAxis(),
        "train_step",
        (
            "grads/layers/0/mlp/down/kernel: ",
            "Linen on mesh data2-fsdp2-tensor2 agrees with itself on one device; NNX on mesh "
            "data2-fsdp2-tensor2 differs from itself on one device",
            "verdict: a partitioning problem, not a Linen/NNX divergence: NNX computes "
            "differently when partitioned on mesh data2-fsdp2-tensor2",
        ),
        mesh_axes=("data", "tensor"),
    ),
    Fault(
        Llama(),
        "optimizer_sharding",
        (
            "optimizer/opt_state/1/0/mu/layers/0/mlp/up/kernel: Linen P('fsdp', ",
            "!= NNX P(",
        ),
        seams={"nnx_train_state": ReshardedTrainState},
    ),
)
