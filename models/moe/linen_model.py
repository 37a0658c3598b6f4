"""The ``moe`` decoder written with Flax Linen: Llama's blocks with a mixture of experts.

Parameters are named as in :mod:`conformance_models.moe.nnx_model`; the only difference
in paths is the unscanned layer list (``layers_0`` here, ``layers/0`` in NNX).
"""

from __future__ import annotations

import jax
from flax import linen as nn

from conformance_models.linen_layers import DenseGeneral
from conformance_models.llama import linen_model as llama
from conformance_models.moe import routing
from conformance_models.moe.config import MoeConfig


class MoeMlp(nn.Module):
    """A router over ``num_experts`` SwiGLU experts whose kernels stack on ``expert``.

    Sows the layer's load-balancing loss as ``intermediates/.../moe_lb_loss``.
    """

    config: MoeConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Route ``x`` ``[b, s, d_model]`` through the experts."""
        cfg = self.config
        logits = DenseGeneral(
            (cfg.d_model,),
            (cfg.num_experts,),
            ("embed", None),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="router",
        )(x)
        probs = routing.router_probabilities(logits)
        self.sow(
            "intermediates",
            routing.AUX_LOSS,
            routing.load_balancing_loss(probs, cfg.lb_weight),
        )
        up_shape = (cfg.num_experts, cfg.d_model, cfg.mlp_dim)
        up_init = nn.with_logical_partitioning(routing.EXPERT_INIT, ("expert", "embed", "mlp"))
        down_init = nn.with_logical_partitioning(routing.EXPERT_INIT, ("expert", "mlp", "embed"))
        gate = self.param("wi_gate", up_init, up_shape, cfg.param_dtype)
        up = self.param("wi_up", up_init, up_shape, cfg.param_dtype)
        down_shape = (cfg.num_experts, cfg.mlp_dim, cfg.d_model)
        down = self.param("wo", down_init, down_shape, cfg.param_dtype)
        return routing.mix_experts(x, probs, gate, up, down, cfg.dtype)


class Block(llama.Block):
    """Llama's decoder block with :class:`MoeMlp` as its ``mlp``."""

    feed_forward = MoeMlp


class Moe(llama.Llama):
    """Llama's decoder with :class:`Block`: logits ``[batch, seq, vocab]``."""

    block = Block
