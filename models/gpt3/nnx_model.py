"""GPT-3-style decoder written with Flax NNX.

Submodules and parameters are named exactly as in :mod:`models.gpt3.linen_model`; the
only difference in paths is the unscanned layer list (``layers/0`` here, ``layers_0``
in Linen).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import common
from models.config import TransformerConfig

EMBED_INIT = nnx.initializers.normal(stddev=0.02)


def kernel_init(num_in: int, num_out: int) -> nnx.Initializer:
    """LeCun-normal init for a kernel whose first ``num_in`` axes are its fan-in."""
    return nnx.initializers.variance_scaling(
        1.0,
        "fan_in",
        "truncated_normal",
        in_axis=tuple(range(num_in)),
        out_axis=tuple(range(num_in, num_in + num_out)),
    )


class DenseGeneral(nnx.Module):
    """Contract the trailing ``len(in_shape)`` input axes with a kernel, plus a bias.

    The kernel is ``in_shape + out_shape`` with logical names ``axis_names``; the
    bias (if any) is ``out_shape`` with the trailing names.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axis_names: tuple[str, ...],
        *,
        use_bias: bool,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.num_in = len(in_shape)
        self.dtype = dtype
        init = nnx.with_partitioning(kernel_init(len(in_shape), len(out_shape)), axis_names)
        self.kernel = nnx.Param(init(rngs.params(), in_shape + out_shape, param_dtype))
        self.bias: nnx.Param | None
        if use_bias:
            bias_init = nnx.with_partitioning(nnx.initializers.zeros, axis_names[self.num_in :])
            self.bias = nnx.Param(bias_init(rngs.params(), out_shape, param_dtype))
        else:
            self.bias = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the projection in ``dtype``."""
        contract = (tuple(range(x.ndim - self.num_in, x.ndim)), tuple(range(self.num_in)))
        y = jax.lax.dot_general(
            x.astype(self.dtype), self.kernel[...].astype(self.dtype), (contract, ((), ()))
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with scale and bias, computed in float32."""

    def __init__(
        self, features: int, *, eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs
    ) -> None:
        self.eps = eps
        self.dtype = dtype
        ones = nnx.with_partitioning(nnx.initializers.ones, ("norm",))
        zeros = nnx.with_partitioning(nnx.initializers.zeros, ("norm",))
        self.scale = nnx.Param(ones(rngs.params(), (features,), param_dtype))
        self.bias = nnx.Param(zeros(rngs.params(), (features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise ``x`` and return it in ``dtype``."""
        x32 = x.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(variance + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


class Embed(nnx.Module):
    """A learned embedding table ``[num_embeddings, features]``."""

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        axis_names: tuple[str, str],
        *,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.dtype = dtype
        init = nnx.with_partitioning(EMBED_INIT, axis_names)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Look up ``ids`` and return the rows in ``dtype``."""
        return jnp.take(self.embedding[...].astype(self.dtype), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Return ``x @ embedding.T`` in ``dtype`` (tied output logits)."""
        return jnp.einsum(
            "bsd,vd->bsv", x.astype(self.dtype), self.embedding[...].astype(self.dtype)
        )


class Attention(nnx.Module):
    """Multi-head causal self-attention with a fused, biased QKV projection."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.dtype = cfg.dtype
        self.qkv = DenseGeneral(
            (cfg.d_model,),
            (3, cfg.num_heads, cfg.head_dim),
            ("embed", "qkv", "heads", "head_dim"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.out = DenseGeneral(
            (cfg.num_heads, cfg.head_dim),
            (cfg.d_model,),
            ("heads", "head_dim", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Attend over ``x`` ``[b, s, d_model]`` under the boolean ``mask``."""
        qkv = self.qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return self.out(common.dot_product_attention(q, k, v, mask, self.dtype))


class Mlp(nnx.Module):
    """Two biased projections with a GELU between them."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.wi = DenseGeneral(
            (cfg.d_model,),
            (cfg.mlp_dim,),
            ("embed", "mlp"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.wo = DenseGeneral(
            (cfg.mlp_dim,),
            (cfg.d_model,),
            ("mlp", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``x`` ``[b, s, d_model]``."""
        return self.wo(jax.nn.gelu(self.wi(x)))


class Block(nnx.Module):
    """One pre-LayerNorm decoder block."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        self.pre_attn_norm = LayerNorm(cfg.d_model, **norm, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.pre_mlp_norm = LayerNorm(cfg.d_model, **norm, rngs=rngs)
        self.mlp = Mlp(cfg, rngs=rngs)
        self.dropout: nnx.Dropout | None
        if cfg.dropout_rate > 0:
            self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        else:
            self.dropout = nnx.data(None)

    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        """Apply attention and MLP with residuals; dropout only when not deterministic."""
        h = self.attn(self.pre_attn_norm(x), mask)
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        x = x + h
        h = self.mlp(self.pre_mlp_norm(x))
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        return x + h


def _stacked_blocks(config: TransformerConfig, rngs: nnx.Rngs) -> Block:
    """Create ``num_layers`` blocks stacked on a leading axis named ``layers``."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs)

    return create(rngs)


class Gpt3(nnx.Module):
    """GPT-3-style decoder returning logits ``[batch, seq, vocab]`` in ``config.dtype``.

    Sows the stacked block outputs ``[num_layers, batch, seq, d_model]`` as the
    ``nnx.Intermediate`` named ``hidden_states``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.config = cfg
        self.token_embed = Embed(
            cfg.vocab_size,
            cfg.d_model,
            ("vocab", "embed"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.pos_embed = Embed(
            cfg.max_seq_len,
            cfg.d_model,
            ("position", "embed"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.layers: Block | nnx.List[Block]
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = LayerNorm(
            cfg.d_model,
            eps=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Run the decoder on ``tokens`` ``[batch, seq]``."""
        cfg = self.config
        x = self.token_embed(tokens) + self.pos_embed(positions)
        mask = common.attention_mask(segment_ids)

        def apply_block(block: Block, x: jax.Array, mask: jax.Array) -> jax.Array:
            return block(x, mask, deterministic=deterministic)

        if cfg.remat:
            apply_block = nnx.remat(apply_block, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:

            def body(x: jax.Array, block: Block, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
                x = apply_block(block, x, mask)
                return x, x

            scan = nnx.scan(
                body,
                in_axes=(nnx.Carry, 0, None),
                out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            x, hidden_states = scan(x, self.layers, mask)
        else:
            outputs = []
            for block in self.layers:
                x = apply_block(block, x, mask)
                outputs.append(x)
            hidden_states = jnp.stack(outputs)
        self.sow(nnx.Intermediate, "hidden_states", hidden_states)
        return self.token_embed.attend(self.final_norm(x))
