"""A toy language model in the style of Flax's own examples (``lm1b``), Linen and NNX.

Unlike :mod:`.models`, decoding is selected by the config (``decode=True``), not by a
call-time mode: each call then takes one token per row, and the attention keeps a
scalar ``index`` into its key/value cache, as Flax's ``decode=True`` attention does. The
model shifts its inputs right itself, so its logits at position ``i`` predict
``tokens[i]``; while decoding it takes the previous token as given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from .models import INIT, linen_embed, linen_head, nnx_embed, nnx_head


@dataclasses.dataclass(frozen=True)
class LmConfig:
    vocab: int
    width: int
    depth: int
    length: int
    decode: bool = False
    dtype: Any = jnp.float32


def shift_right(tokens: jax.Array) -> jax.Array:
    """``tokens`` moved one position right, with 0 in front (the model's own shift)."""
    return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Single-head softmax attention of ``q [b, t, w]`` over ``k, v [b, s, w]``."""
    scores = jnp.einsum("btw,bsw->bts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bts,bsw->btw", jax.nn.softmax(scores, axis=-1), v)


def sequence_mask(segment_ids: jax.Array) -> jax.Array:
    """``[b, t, t]``: causal, and only real keys."""
    width = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((width, width), bool))
    return causal[None] & (segment_ids != 0)[:, None, :]


class LinenAttention(nn.Module):
    config: LmConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.config

        def dense(name: str, names: tuple[str, str]) -> nn.Dense:
            init = nn.with_logical_partitioning(INIT, names)
            return nn.Dense(cfg.width, dtype=cfg.dtype, use_bias=False, name=name, kernel_init=init)

        q, k, v = (dense(n, ("embed", "mlp"))(x) for n in ("query", "key", "value"))
        mask = sequence_mask(segment_ids)
        if cfg.decode:
            ready = self.has_variable("cache", "cached_key")
            shape = (x.shape[0], cfg.length, cfg.width)
            zeros = nn.with_logical_partitioning(jnp.zeros, ("batch", None, "mlp"))
            cached_k = self.variable("cache", "cached_key", zeros, shape, cfg.dtype)
            cached_v = self.variable("cache", "cached_value", zeros, shape, cfg.dtype)
            index = self.variable(
                "cache", "index", nn.with_logical_partitioning(jnp.zeros, ()), (), jnp.int32
            )
            if ready:
                at = index.value
                cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, at, 0))
                cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, at, 0))
                index.value = at + 1
                k, v = cached_k.value, cached_v.value
                mask = (jnp.arange(cfg.length) <= at)[None, None, :]
        out = attend(q, k, v, mask)
        init = nn.with_logical_partitioning(INIT, ("mlp", "embed"))
        return nn.Dense(cfg.width, dtype=cfg.dtype, use_bias=False, name="out", kernel_init=init)(
            out
        )


class LinenLm(nn.Module):
    config: LmConfig

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        del positions
        cfg = self.config
        inputs = tokens if cfg.decode else shift_right(tokens)
        x = linen_embed(cfg.vocab, cfg.width, cfg.dtype)(inputs)
        for i in range(cfg.depth):
            norm = nn.LayerNorm(
                dtype=cfg.dtype,
                use_bias=False,
                scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                name=f"norm_{i}",
            )
            x = x + LinenAttention(cfg, name=f"block_{i}")(norm(x), segment_ids)
        return linen_head(cfg.vocab, cfg.dtype)(x)


class NnxAttention(nnx.Module):
    def __init__(self, config: LmConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config

        def linear(names: tuple[str, str]) -> nnx.Linear:
            init = nnx.with_partitioning(INIT, names)
            return nnx.Linear(
                config.width,
                config.width,
                use_bias=False,
                dtype=config.dtype,
                kernel_init=init,
                rngs=rngs,
            )

        self.query, self.key, self.value = (linear(("embed", "mlp")) for _ in range(3))
        self.out = linear(("mlp", "embed"))
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch_size: int) -> None:
        shape = (batch_size, self.config.length, self.config.width)
        names = ("batch", None, "mlp")
        self.cached_key = nnx.Cache(jnp.zeros(shape, self.config.dtype), out_sharding=names)
        self.cached_value = nnx.Cache(jnp.zeros(shape, self.config.dtype), out_sharding=names)
        self.index = nnx.Cache(jnp.zeros((), jnp.int32), out_sharding=())

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q, k, v = self.query(x), self.key(x), self.value(x)
        if not self.config.decode:
            return self.out(attend(q, k, v, sequence_mask(segment_ids)))
        if self.index is None or self.cached_key is None or self.cached_value is None:
            raise ValueError("decoding needs a cache: call init_cache(batch_size) first")
        at = self.index[...]
        self.cached_key[...] = jax.lax.dynamic_update_slice(self.cached_key[...], k, (0, at, 0))
        self.cached_value[...] = jax.lax.dynamic_update_slice(self.cached_value[...], v, (0, at, 0))
        self.index[...] = at + 1
        mask = (jnp.arange(self.config.length) <= at)[None, None, :]
        return self.out(attend(q, self.cached_key[...], self.cached_value[...], mask))


class NnxLm(nnx.Module):
    def __init__(self, config: LmConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx_embed(config.vocab, config.width, config.dtype, rngs)
        self.norms = nnx.List(
            [
                nnx.LayerNorm(
                    config.width,
                    use_bias=False,
                    dtype=config.dtype,
                    scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                    rngs=rngs,
                )
                for _ in range(config.depth)
            ]
        )
        self.blocks = nnx.List([NnxAttention(config, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx_head(config.width, config.vocab, config.dtype, rngs)

    def init_cache(self, batch_size: int) -> None:
        """An empty key/value cache at index 0 in every block."""
        for block in self.blocks:
            block.init_cache(batch_size)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        del positions
        x = self.embed(tokens if self.config.decode else shift_right(tokens))
        for norm, block in zip(self.norms, self.blocks, strict=True):
            x = x + block(norm(x), segment_ids)
        return self.head(x)
