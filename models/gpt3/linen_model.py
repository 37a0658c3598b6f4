"""GPT-3-style decoder written with Flax Linen.

Submodules and parameters are named exactly as in :mod:`conformance_models.gpt3.nnx_model`; the
only difference in paths is the unscanned layer list (``layers_0`` here, ``layers/0``
in NNX).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from conformance_models import common
from conformance_models.config import TransformerConfig
from conformance_models.linen_layers import DenseGeneral, Embed, KVCache, apply_layers, constrain


class LayerNorm(nn.Module):
    """LayerNorm over the last axis with scale and bias, computed in float32."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise ``x`` and return it in ``dtype``."""
        features = (x.shape[-1],)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            features,
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
            features,
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(variance + self.eps)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


class Attention(nn.Module):
    """Multi-head causal self-attention with a fused, biased QKV projection."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, mode: str) -> jax.Array:
        """Attend over ``x`` ``[b, s, d_model]``, causally within each segment."""
        cfg = self.config
        x = constrain(x, common.ACTIVATION_EMBED, cfg)
        qkv = DenseGeneral(
            (cfg.d_model,),
            (3, cfg.num_heads, cfg.head_dim),
            ("embed", "qkv", "heads", "head_dim"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            name="qkv",
        )(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        k, v, mask = KVCache(cfg, name="kv_cache")(k, v, segment_ids, mode)
        out = common.dot_product_attention(q, k, v, mask, cfg.dtype)
        out = DenseGeneral(
            (cfg.num_heads, cfg.head_dim),
            (cfg.d_model,),
            ("heads", "head_dim", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            name="out",
        )(out)
        return constrain(out, common.ACTIVATION_EMBED, cfg)


class Mlp(nn.Module):
    """Two biased projections with a GELU between them."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``x`` ``[b, s, d_model]``."""
        cfg = self.config
        h = DenseGeneral(
            (cfg.d_model,),
            (cfg.mlp_dim,),
            ("embed", "mlp"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            name="wi",
        )(x)
        h = constrain(jax.nn.gelu(h), common.ACTIVATION_MLP, cfg)
        return DenseGeneral(
            (cfg.mlp_dim,),
            (cfg.d_model,),
            ("mlp", "embed"),
            use_bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            name="wo",
        )(h)


class Block(nn.Module):
    """One pre-LayerNorm decoder block.

    Returns ``(x, x)`` so the same module serves as an ``nn.scan`` body (carry, output).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, deterministic: bool, mode: str
    ) -> tuple[jax.Array, jax.Array]:
        """Apply attention and MLP with residuals; dropout only when not deterministic."""
        cfg = self.config
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        h = LayerNorm(**norm, name="pre_attn_norm")(x)
        h = Attention(cfg, name="attn")(h, segment_ids, mode)
        if cfg.dropout_rate > 0:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        x = x + h
        h = LayerNorm(**norm, name="pre_mlp_norm")(x)
        h = Mlp(cfg, name="mlp")(h)
        if cfg.dropout_rate > 0:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        x = x + h
        return x, x


class Gpt3(nn.Module):
    """GPT-3-style decoder returning logits ``[batch, seq, vocab]`` in ``config.dtype``.

    Sows the stacked block outputs ``[num_layers, batch, seq, d_model]`` as
    ``intermediates/hidden_states``.
    """

    config: TransformerConfig

    @nn.compact
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
        token per row at ``positions`` against the cache.

        With ``targets`` and ``target_weights`` (a training call), returns the summed
        weighted cross entropy, computed ``config.vocab_tiles`` slices at a time
        (``common.tiled_token_loss``), instead of the logits.
        """
        cfg = self.config
        token_embed = Embed(
            cfg.vocab_size,
            cfg.d_model,
            ("vocab", "embed"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="token_embed",
        )
        pos_embed = Embed(
            cfg.max_seq_len,
            cfg.d_model,
            ("position", "embed"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="pos_embed",
        )
        x = constrain(token_embed(tokens) + pos_embed(positions), common.ACTIVATION_EMBED, cfg)
        x, hidden_states = apply_layers(
            Block, cfg, x, segment_ids, deterministic=deterministic, mode=mode
        )
        if mode == "forward":
            self.sow("intermediates", "hidden_states", hidden_states)

        x = LayerNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="final_norm")(x)
        if targets is not None:
            return common.tiled_token_loss(
                token_embed.attend, x, targets, target_weights, cfg.vocab_tiles
            )
        return constrain(token_embed.attend(x), common.ACTIVATION_VOCAB, cfg)
