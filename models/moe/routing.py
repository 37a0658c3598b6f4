"""The routing arithmetic both backends of the ``moe`` family share: pure functions of arrays.

Each backend owns its parameters (router and expert kernels, named and annotated in its
own module); what is computed from them is written once here, as
:mod:`conformance_models.common` is for the dense families.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from conformance_models import common

AUX_LOSS = "moe_lb_loss"
"""The name under which every MoE layer sows its load-balancing loss."""

EXPERT_INIT = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
"""LeCun-normal init of a stack of expert kernels ``[experts, fan_in, fan_out]``."""


def router_probabilities(logits: jax.Array) -> jax.Array:
    """The router's softmax over experts, in float32: ``[batch, seq, experts]``."""
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def load_balancing_loss(probs: jax.Array, weight: float) -> jax.Array:
    """``weight * experts * sum_e mean_prob_e ** 2`` over every token (``weight`` when even).

    The importance form of Switch's loss: Switch multiplies each expert's share of
    top-1 assignments by its mean probability; using the mean probability for both
    keeps it differentiable everywhere and free of argmax ties, which would make two
    correct backends disagree by a whole expert on a rounding difference.
    """
    mean_prob = probs.reshape(-1, probs.shape[-1]).mean(0)
    return weight * probs.shape[-1] * jnp.sum(jnp.square(mean_prob))


def mix_experts(
    x: jax.Array, probs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, dtype: Any
) -> jax.Array:
    """Every expert's SwiGLU MLP of ``x`` ``[b, s, d]``, weighted by ``probs``: ``[b, s, d]``.

    ``gate`` and ``up`` are ``[experts, d, mlp]``, ``down`` ``[experts, mlp, d]``; each
    token's output is the router-weighted sum over experts (dense routing: every expert
    computes every token, as small models and correctness tests afford).
    """
    x = x.astype(dtype)
    hidden = jax.nn.silu(jnp.einsum("bsd,edm->bsem", x, gate.astype(dtype)))
    hidden = hidden * jnp.einsum("bsd,edm->bsem", x, up.astype(dtype))
    return jnp.einsum(
        "bsem,emd,bse->bsd",
        hidden,
        down.astype(dtype),
        probs.astype(dtype),
        out_sharding=common.explicit_layout(x),
    )
