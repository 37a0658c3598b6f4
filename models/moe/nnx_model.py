"""The ``moe`` decoder written with Flax NNX: Llama's blocks with a mixture of experts.

Parameters are named as in :mod:`conformance_models.moe.linen_model`.
"""

from __future__ import annotations

import jax
from flax import nnx

from conformance_models.llama import nnx_model as llama
from conformance_models.moe import routing
from conformance_models.moe.config import MoeConfig
from conformance_models.nnx_layers import DenseGeneral, gathered


class MoeMlp(nnx.Module):
    """A router over ``num_experts`` SwiGLU experts whose kernels stack on ``expert``.

    Sows the layer's load-balancing loss as the ``nnx.Intermediate`` ``moe_lb_loss``.
    """

    def __init__(self, config: MoeConfig, *, rngs: nnx.Rngs) -> None:
        cfg = self.config = config
        self.router = DenseGeneral(
            (cfg.d_model,),
            (cfg.num_experts,),
            ("embed", None),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        up_shape = (cfg.num_experts, cfg.d_model, cfg.mlp_dim)
        up_init = nnx.with_partitioning(routing.EXPERT_INIT, ("expert", "embed", "mlp"))
        down_init = nnx.with_partitioning(routing.EXPERT_INIT, ("expert", "mlp", "embed"))
        self.wi_gate = nnx.Param(up_init(rngs.params(), up_shape, cfg.param_dtype))
        self.wi_up = nnx.Param(up_init(rngs.params(), up_shape, cfg.param_dtype))
        down_shape = (cfg.num_experts, cfg.mlp_dim, cfg.d_model)
        self.wo = nnx.Param(down_init(rngs.params(), down_shape, cfg.param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Route ``x`` ``[b, s, d_model]`` through the experts."""
        cfg = self.config
        probs = routing.router_probabilities(self.router(x))
        self.sow(
            nnx.Intermediate,
            routing.AUX_LOSS,
            routing.load_balancing_loss(probs, cfg.lb_weight),
        )
        kernels = (gathered(w[...], x) for w in (self.wi_gate, self.wi_up, self.wo))
        return routing.mix_experts(x, probs, *kernels, cfg.dtype)


class Block(llama.Block):
    """Llama's decoder block with :class:`MoeMlp` as its ``mlp``."""

    feed_forward = MoeMlp


class Moe(llama.Llama):
    """Llama's decoder with :class:`Block`: logits ``[batch, seq, vocab]``."""

    block = Block
