"""A toy decoder written as several public model libraries are: the cache is a value.

The modules hold no cache. Called with ``cache=`` (a dict of per-block running sums and
counts of real positions) they return ``(logits, cache)``; called without, the logits.
The zoo's own ``init_cache(depth, batch_size, width, dtype)`` makes an empty cache; a
prefill and a decode step are the same call, so the model serves a ``mode`` keyword
(prefill style) and plain calls (token by token) alike. The NNX side keys its cache as
its blocks are keyed (``blocks/0``), Linen as its are (``block_0``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from .models import (
    INIT,
    ToyConfig,
    causal_mean,
    linen_embed,
    linen_head,
    nnx_embed,
    nnx_head,
    running_mean,
)

Cache = dict[str, Any]


def init_cache(depth: int, batch_size: int, width: int, dtype: Any) -> list[Cache]:
    """The zoo's own empty cache: per block, a running ``total`` and ``count``."""
    return [
        {"total": jnp.zeros((batch_size, width), dtype), "count": jnp.zeros((batch_size,))}
        for _ in range(depth)
    ]


def _named(block: Cache) -> Cache:
    """One block's cache leaves with their logical axis names."""
    return {
        "total": nn.LogicallyPartitioned(block["total"], ("batch", "embed")),
        "count": nn.LogicallyPartitioned(block["count"], ("batch",)),
    }


def linen_cache(config: ToyConfig, batch_size: int) -> Cache:
    """The Linen side's cache, keyed ``block_{i}`` as its blocks are."""
    blocks = init_cache(config.depth, batch_size, config.width, config.dtype)
    return {f"block_{i}": _named(block) for i, block in enumerate(blocks)}


def nnx_cache(config: ToyConfig, batch_size: int) -> Cache:
    """The NNX side's cache, keyed ``blocks/{i}`` as its blocks are."""
    blocks = init_cache(config.depth, batch_size, config.width, config.dtype)
    return {"blocks": {str(i): _named(block) for i, block in enumerate(blocks)}}


def _mix(x: jax.Array, segment_ids: jax.Array, cache: Cache | None) -> tuple[jax.Array, Any]:
    """The causal running mean, continued from ``cache`` when given; the new cache."""
    if cache is None:
        return causal_mean(x, segment_ids), None
    total, count, mixed = running_mean(x, segment_ids, cache["total"], cache["count"])
    return mixed, {"total": total.astype(cache["total"].dtype), "count": count.astype(jnp.float32)}


class LinenFnBlock(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, cache: Cache | None
    ) -> tuple[jax.Array, Any]:
        mixed, cache = _mix(x, segment_ids, cache)
        proj = nn.Dense(
            self.config.width,
            dtype=self.config.dtype,
            name="proj",
            kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )
        return x + jnp.tanh(proj(mixed)), cache


class LinenFn(nn.Module):
    config: ToyConfig
    block: type[nn.Module] = LinenFnBlock

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        mode: str = "forward",
        cache: Cache | None = None,
    ) -> Any:
        del positions, mode
        cfg = self.config
        x = linen_embed(cfg.vocab, cfg.width, cfg.dtype)(tokens)
        new: Cache = {}
        for i in range(cfg.depth):
            name = f"block_{i}"
            block = self.block(cfg, name=name)
            x, new[name] = block(x, segment_ids, None if cache is None else cache[name])
        logits = linen_head(cfg.vocab, cfg.dtype)(x)
        return logits if cache is None else (logits, new)


class NnxFnBlock(nnx.Module):
    def __init__(self, config: ToyConfig, *, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(
            config.width,
            config.width,
            dtype=config.dtype,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
        )

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, cache: Cache | None
    ) -> tuple[jax.Array, Any]:
        mixed, cache = _mix(x, segment_ids, cache)
        return x + jnp.tanh(self.proj(mixed)), cache


class NnxFn(nnx.Module):
    def __init__(self, config: ToyConfig, rngs: nnx.Rngs, block: type = NnxFnBlock) -> None:
        self.embed = nnx_embed(config.vocab, config.width, config.dtype, rngs)
        self.blocks = nnx.List([block(config, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx_head(config.width, config.vocab, config.dtype, rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        mode: str = "forward",
        cache: Cache | None = None,
    ) -> Any:
        del positions, mode
        x = self.embed(tokens)
        new: dict[str, Any] = {}
        for i, block in enumerate(self.blocks):
            own = None if cache is None else cache["blocks"][str(i)]
            x, new[str(i)] = block(x, segment_ids, own)
        logits = self.head(x)
        return logits if cache is None else (logits, {"blocks": new})
