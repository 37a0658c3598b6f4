"""A toy causal decoder, once in Linen and once in NNX.

Each block mixes positions by a causal running mean over real tokens (parameter-free)
and applies a residual MLP. No ``hidden_states`` are sown, modules take no
``deterministic`` keyword (training is ``train=True``), and sizes are not ``tiny``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("layers", None),
)
INIT = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab: int
    width: int
    hidden: int
    depth: int
    length: int
    stacked: bool = False
    checkpointed: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.float32


def causal_mean(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each position's mean over the real positions up to it."""
    real = (segment_ids != 0)[..., None].astype(x.dtype)
    total = jnp.cumsum(x * real, axis=1)
    count = jnp.maximum(jnp.cumsum(real, axis=1), 1.0)
    return total / count


class LinenBlock(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.config
        h = nn.LayerNorm(
            dtype=cfg.dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name="norm",
        )(causal_mean(x, segment_ids))
        h = nn.Dense(
            cfg.hidden,
            dtype=cfg.dtype,
            name="up",
            kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(h)
        h = nn.Dense(
            cfg.width,
            dtype=cfg.dtype,
            name="down",
            kernel_init=nn.with_logical_partitioning(INIT, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )(nn.gelu(h))
        return x + h, None


class LinenToy(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, train: bool = False
    ) -> jax.Array:
        del positions
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab,
            cfg.width,
            dtype=cfg.dtype,
            name="embed",
            embedding_init=nn.with_logical_partitioning(INIT, ("vocab", "embed")),
        )
        x = nn.Dropout(cfg.dropout)(embed(tokens), deterministic=not train)
        block: Any = nn.remat(LinenBlock) if cfg.checkpointed else LinenBlock
        if cfg.stacked:
            x, _ = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=cfg.depth,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="blocks")(x, segment_ids)
        else:
            for i in range(cfg.depth):
                x, _ = block(cfg, name=f"block_{i}")(x, segment_ids)
        return nn.Dense(
            cfg.vocab,
            dtype=cfg.dtype,
            use_bias=False,
            name="head",
            kernel_init=nn.with_logical_partitioning(INIT, ("embed", "vocab")),
        )(x)


class NnxBlock(nnx.Module):
    def __init__(self, config: ToyConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.norm = nnx.LayerNorm(
            config.width,
            dtype=config.dtype,
            rngs=rngs,
            scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)),
        )
        self.up = nnx.Linear(
            config.width,
            config.hidden,
            dtype=config.dtype,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
        )
        self.down = nnx.Linear(
            config.hidden,
            config.width,
            dtype=config.dtype,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)),
        )

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        return x + self.down(nnx.gelu(self.up(self.norm(causal_mean(x, segment_ids)))))


class NnxToy(nnx.Module):
    def __init__(self, config: ToyConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx.Embed(
            config.vocab,
            config.width,
            dtype=config.dtype,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(INIT, ("vocab", "embed")),
        )
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        if config.stacked:

            @nnx.split_rngs(splits=config.depth)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(rngs: nnx.Rngs) -> NnxBlock:
                return NnxBlock(config, rngs=rngs)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(config, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx.Linear(
            config.width,
            config.vocab,
            use_bias=False,
            dtype=config.dtype,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(INIT, ("embed", "vocab")),
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, train: bool = False
    ) -> jax.Array:
        del positions
        x = self.dropout(self.embed(tokens), deterministic=not train)

        def apply(block: NnxBlock, x: jax.Array) -> jax.Array:
            return block(x, segment_ids)

        if self.config.checkpointed:
            apply = nnx.remat(apply)
        if self.config.stacked:

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def step(block: NnxBlock, x: jax.Array) -> jax.Array:
                return apply(block, x)

            x = step(self.blocks, x)
        else:
            for block in self.blocks:
                x = apply(block, x)
        return self.head(x)
