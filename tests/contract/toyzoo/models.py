"""A toy causal decoder, once in Linen and once in NNX.

Each block mixes positions by a causal running mean over real tokens (parameter-free)
and applies a residual MLP. No ``hidden_states`` are sown, modules take no
``deterministic`` keyword (training is ``train=True``), and sizes are not ``tiny``.
Serving (``mode="prefill"`` then ``"decode"``) keeps each block's running sum and count
of real positions as its cache.
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


def linen_embed(vocab: int, width: int, dtype: Any) -> nn.Embed:
    """The token embedding, ``[vocab, embed]``, as every toy model's Linen side names it."""
    init = nn.with_logical_partitioning(INIT, ("vocab", "embed"))
    return nn.Embed(vocab, width, dtype=dtype, name="embed", embedding_init=init)


def linen_head(vocab: int, dtype: Any) -> nn.Dense:
    """The unbiased output projection, ``[embed, vocab]``, named ``head``."""
    init = nn.with_logical_partitioning(INIT, ("embed", "vocab"))
    return nn.Dense(vocab, dtype=dtype, use_bias=False, name="head", kernel_init=init)


def nnx_embed(vocab: int, width: int, dtype: Any, rngs: nnx.Rngs) -> nnx.Embed:
    """The NNX twin of :func:`linen_embed`."""
    init = nnx.with_partitioning(INIT, ("vocab", "embed"))
    return nnx.Embed(vocab, width, dtype=dtype, embedding_init=init, rngs=rngs)


def nnx_head(width: int, vocab: int, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    """The NNX twin of :func:`linen_head`."""
    init = nnx.with_partitioning(INIT, ("embed", "vocab"))
    return nnx.Linear(width, vocab, use_bias=False, dtype=dtype, kernel_init=init, rngs=rngs)


def running_mean(
    x: jax.Array, segment_ids: jax.Array, total: jax.Array, count: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each position's mean over the real positions up to it, after a cached prefix.

    ``total`` ``[batch, width]`` and ``count`` ``[batch]`` sum the cached positions
    (zeros for a whole sequence). Returns the new total, the new count and the means.
    """
    real = (segment_ids != 0)[..., None].astype(x.dtype)
    sums = total[:, None].astype(x.dtype) + jnp.cumsum(x * real, axis=1)
    counts = count[:, None, None].astype(x.dtype) + jnp.cumsum(real, axis=1)
    return sums[:, -1], counts[:, -1, 0], sums / jnp.maximum(counts, 1.0)


def causal_mean(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each position's mean over the real positions up to it."""
    batch, width = x.shape[0], x.shape[-1]
    return running_mean(x, segment_ids, jnp.zeros((batch, width)), jnp.zeros((batch,)))[2]


class LinenBlock(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, mode: str = "forward"
    ) -> tuple[jax.Array, None]:
        cfg = self.config
        if mode == "forward":
            mixed = causal_mean(x, segment_ids)
        else:
            exists = self.has_variable("cache", "total")
            total = self.variable(
                "cache",
                "total",
                nn.with_logical_partitioning(jnp.zeros, ("batch", "embed")),
                (x.shape[0], cfg.width),
                cfg.dtype,
            )
            count = self.variable(
                "cache",
                "count",
                nn.with_logical_partitioning(jnp.zeros, ("batch",)),
                (x.shape[0],),
                jnp.float32,
            )
            new_total, new_count, mixed = running_mean(x, segment_ids, total.value, count.value)
            if exists:
                total.value, count.value = new_total, new_count.astype(jnp.float32)
        h = nn.LayerNorm(
            dtype=cfg.dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name="norm",
        )(mixed)
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
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        train: bool = False,
        mode: str = "forward",
    ) -> jax.Array:
        del positions
        cfg = self.config
        embed = linen_embed(cfg.vocab, cfg.width, cfg.dtype)
        x = nn.Dropout(cfg.dropout)(embed(tokens), deterministic=not train)
        block: Any = nn.remat(LinenBlock, static_argnums=(3,)) if cfg.checkpointed else LinenBlock
        if cfg.stacked:
            x, _ = nn.scan(
                block,
                variable_axes={"params": 0, "cache": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.depth,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="blocks")(x, segment_ids, mode)
        else:
            for i in range(cfg.depth):
                x, _ = block(cfg, name=f"block_{i}")(x, segment_ids, mode)
        return linen_head(cfg.vocab, cfg.dtype)(x)


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
        self.total: nnx.Cache | None = nnx.data(None)
        self.count: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch_size: int, stacked: int | None = None) -> None:
        """An empty cache; with ``stacked`` layers, a leading axis named ``layers``."""
        lead, names = ((stacked,), ("layers",)) if stacked else ((), ())
        self.total = nnx.Cache(
            jnp.zeros((*lead, batch_size, self.config.width), self.config.dtype),
            out_sharding=(*names, "batch", "embed"),
        )
        self.count = nnx.Cache(
            jnp.zeros((*lead, batch_size), jnp.float32), out_sharding=(*names, "batch")
        )

    def __call__(self, x: jax.Array, segment_ids: jax.Array, mode: str = "forward") -> jax.Array:
        if mode == "forward":
            mixed = causal_mean(x, segment_ids)
        else:
            if self.total is None or self.count is None:
                raise ValueError(f"mode {mode!r} needs a cache: call init_cache() first")
            total, count, mixed = running_mean(x, segment_ids, self.total[...], self.count[...])
            self.total[...], self.count[...] = total, count.astype(jnp.float32)
        return x + self.down(nnx.gelu(self.up(self.norm(mixed))))


class NnxToy(nnx.Module):
    def __init__(self, config: ToyConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx_embed(config.vocab, config.width, config.dtype, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        if config.stacked:

            @nnx.split_rngs(splits=config.depth)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(rngs: nnx.Rngs) -> NnxBlock:
                return NnxBlock(config, rngs=rngs)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(config, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx_head(config.width, config.vocab, config.dtype, rngs)

    def init_cache(self, batch_size: int) -> None:
        """An empty serving cache for ``batch_size`` rows in every block."""
        if self.config.stacked:
            self.blocks.init_cache(batch_size, stacked=self.config.depth)
        else:
            for block in self.blocks:
                block.init_cache(batch_size)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        train: bool = False,
        mode: str = "forward",
    ) -> jax.Array:
        del positions
        x = self.dropout(self.embed(tokens), deterministic=not train)

        def apply(block: NnxBlock, x: jax.Array) -> jax.Array:
            return block(x, segment_ids, mode)

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
