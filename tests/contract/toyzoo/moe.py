"""A toy mixture-of-experts model, once in Linen and once in NNX.

Each block mixes positions by the causal running mean of :mod:`.models`, then routes
every token through a dense mixture of experts: a router's softmax weighs the experts'
MLPs, whose kernels are stacked on a leading axis named ``expert``. The router sows a
Switch-style load-balancing loss, ``moe_lb_loss``: the experts' share of top-1
assignments times their mean router probability, summed and scaled by the expert count
and :data:`LB_WEIGHT`; the harness's train step adds it to the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from .models import INIT, causal_mean, linen_embed, linen_head, nnx_embed, nnx_head

LB_WEIGHT = 0.01
AUX_LOSS = "moe_lb_loss"


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    vocab: int
    width: int
    hidden: int
    experts: int
    depth: int
    length: int
    dtype: Any = jnp.float32


def load_balancing(probs: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The load-balancing loss of router probabilities ``[b, t, experts]`` on real tokens."""
    real = (segment_ids != 0)[..., None].astype(jnp.float32)
    tokens = jnp.maximum(real.sum(), 1.0)
    experts = probs.shape[-1]
    chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts) * real
    share, mean_prob = chosen.sum((0, 1)) / tokens, (probs * real).sum((0, 1)) / tokens
    return LB_WEIGHT * experts * jnp.sum(share * mean_prob)


def mixture(x: jax.Array, probs: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Every expert's MLP of ``x`` ``[b, t, w]``, weighted by ``probs``: ``[b, t, w]``."""
    hidden = jax.nn.gelu(jnp.einsum("btw,ewh->bteh", x, up))
    return jnp.einsum("bteh,ehw,bte->btw", hidden, down, probs)


class LinenMoeBlock(nn.Module):
    config: MoeConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.config
        h = nn.LayerNorm(
            dtype=cfg.dtype,
            use_bias=False,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            name="norm",
        )(causal_mean(x, segment_ids))
        logits = nn.Dense(
            cfg.experts,
            dtype=cfg.dtype,
            use_bias=False,
            name="router",
            kernel_init=nn.with_logical_partitioning(INIT, ("embed", None)),
        )(h)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        self.sow("intermediates", AUX_LOSS, load_balancing(probs, segment_ids))
        up = self.param(
            "up",
            nn.with_logical_partitioning(INIT, ("expert", "embed", "mlp")),
            (cfg.experts, cfg.width, cfg.hidden),
        )
        down = self.param(
            "down",
            nn.with_logical_partitioning(INIT, ("expert", "mlp", "embed")),
            (cfg.experts, cfg.hidden, cfg.width),
        )
        return x + mixture(h, probs.astype(cfg.dtype), up, down)


class LinenMoe(nn.Module):
    config: MoeConfig

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        del positions
        cfg = self.config
        x = linen_embed(cfg.vocab, cfg.width, cfg.dtype)(tokens)
        for i in range(cfg.depth):
            x = LinenMoeBlock(cfg, name=f"block_{i}")(x, segment_ids)
        return linen_head(cfg.vocab, cfg.dtype)(x)


class NnxMoeBlock(nnx.Module):
    def __init__(self, config: MoeConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.norm = nnx.LayerNorm(
            config.width,
            use_bias=False,
            dtype=config.dtype,
            scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
            rngs=rngs,
        )
        self.router = nnx.Linear(
            config.width,
            config.experts,
            use_bias=False,
            dtype=config.dtype,
            kernel_init=nnx.with_partitioning(INIT, ("embed", None)),
            rngs=rngs,
        )
        up_init = nnx.with_partitioning(INIT, ("expert", "embed", "mlp"))
        down_init = nnx.with_partitioning(INIT, ("expert", "mlp", "embed"))
        self.up = nnx.Param(up_init(rngs.params(), (config.experts, config.width, config.hidden)))
        self.down = nnx.Param(
            down_init(rngs.params(), (config.experts, config.hidden, config.width))
        )

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        h = self.norm(causal_mean(x, segment_ids))
        probs = jax.nn.softmax(self.router(h).astype(jnp.float32), axis=-1)
        self.sow(nnx.Intermediate, AUX_LOSS, load_balancing(probs, segment_ids))
        dtype = self.config.dtype
        return x + mixture(h, probs.astype(dtype), self.up[...], self.down[...])


class NnxMoe(nnx.Module):
    def __init__(self, config: MoeConfig, rngs: nnx.Rngs) -> None:
        self.embed = nnx_embed(config.vocab, config.width, config.dtype, rngs)
        self.blocks = nnx.List([NnxMoeBlock(config, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx_head(config.width, config.vocab, config.dtype, rngs)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        del positions
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.head(x)
