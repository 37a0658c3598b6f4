"""GPT-3-style decoder written with Flax NNX.

Submodules and parameters are named exactly as in :mod:`conformance_models.gpt3.linen_model`; the
only difference in paths is the unscanned layer list (``layers/0`` here, ``layers_0``
in Linen).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from conformance_models import common
from conformance_models.config import TransformerConfig
from conformance_models.nnx_layers import (
    DenseGeneral,
    Embed,
    KVCache,
    apply_layers,
    constrain,
    init_caches,
    make_layers,
)


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


class Attention(nnx.Module):
    """Multi-head causal self-attention with a fused, biased QKV projection."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.config = cfg
        self.dtype = cfg.dtype
        self.qkv = DenseGeneral(
            (cfg.d_model,),
            (3, cfg.num_heads, cfg.head_dim),
            ("embed", "qkv", "heads", "head_dim"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            rngs=rngs,
        )
        self.kv_cache = KVCache(cfg)
        self.out = DenseGeneral(
            (cfg.num_heads, cfg.head_dim),
            (cfg.d_model,),
            ("heads", "head_dim", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, segment_ids: jax.Array, mode: str) -> jax.Array:
        """Attend over ``x`` ``[b, s, d_model]``, causally within each segment."""
        qkv = self.qkv(constrain(x, common.ACTIVATION_EMBED, self.config))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        k, v, mask = self.kv_cache(k, v, segment_ids, mode)
        out = self.out(common.dot_product_attention(q, k, v, mask, self.dtype))
        return constrain(out, common.ACTIVATION_EMBED, self.config)


class Mlp(nnx.Module):
    """Two biased projections with a GELU between them."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.config = cfg
        self.wi = DenseGeneral(
            (cfg.d_model,),
            (cfg.mlp_dim,),
            ("embed", "mlp"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            rngs=rngs,
        )
        self.wo = DenseGeneral(
            (cfg.mlp_dim,),
            (cfg.d_model,),
            ("mlp", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``x`` ``[b, s, d_model]``."""
        return self.wo(constrain(jax.nn.gelu(self.wi(x)), common.ACTIVATION_MLP, self.config))


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

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, *, deterministic: bool, mode: str
    ) -> jax.Array:
        """Apply attention and MLP with residuals; dropout only when not deterministic."""
        h = self.attn(self.pre_attn_norm(x), segment_ids, mode)
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        x = x + h
        h = self.mlp(self.pre_mlp_norm(x))
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        return x + h


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
        self.layers = make_layers(Block, cfg, rngs)
        self.final_norm = LayerNorm(
            cfg.d_model,
            eps=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def init_cache(self, batch_size: int) -> None:
        """Create an empty KV cache for ``batch_size`` rows in every attention layer."""
        init_caches(self.layers, self.config, batch_size)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        deterministic: bool = True,
        mode: str = "forward",
        targets: jax.Array | None = None,
        target_weights: jax.Array | None = None,
    ) -> jax.Array:
        """Run the decoder on ``tokens`` ``[batch, seq]`` in ``mode``, one of ``common.MODES``.

        ``forward`` runs the whole sequence and sows ``hidden_states``; ``prefill``
        does the same for a right-padded prompt and fills the cache; ``decode`` runs one
        token per row at ``positions`` against the cache. Serving needs
        :meth:`init_cache` first.

        With ``targets`` and ``target_weights`` (a training call), returns the summed
        weighted cross entropy, computed ``config.vocab_tiles`` slices at a time
        (``common.tiled_token_loss``), instead of the logits.
        """
        x = self.token_embed(tokens) + self.pos_embed(positions)
        x = constrain(x, common.ACTIVATION_EMBED, self.config)
        x, hidden_states = apply_layers(
            self.layers, self.config, x, segment_ids, deterministic=deterministic, mode=mode
        )
        if mode == "forward":
            self.sow(nnx.Intermediate, "hidden_states", hidden_states)
        x = self.final_norm(x)
        if targets is not None:
            return common.tiled_token_loss(
                self.token_embed.attend, x, targets, target_weights, self.config.vocab_tiles
            )
        return constrain(self.token_embed.attend(x), common.ACTIVATION_VOCAB, self.config)
