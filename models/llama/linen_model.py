"""Llama-style decoder written with Flax Linen.

Submodules and parameters are named exactly as in :mod:`conformance_models.llama.nnx_model`; the
only difference in paths is the unscanned layer list (``layers_0`` here, ``layers/0``
in NNX).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from conformance_models import common
from conformance_models.config import TransformerConfig
from conformance_models.linen_layers import DenseGeneral, Embed, KVCache, apply_layers, constrain


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned scale, computed in float32."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise ``x`` and return it in ``dtype``."""
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE on queries and keys."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, mode: str
    ) -> jax.Array:
        """Attend over ``x`` ``[b, s, d_model]``, causally within each segment."""
        cfg = self.config
        dense = {
            "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype,
            "aqt_mode": cfg.aqt_mode,
            "fp8": cfg.fp8,
        }
        q_shape = (cfg.num_heads, cfg.head_dim)
        kv_shape = (cfg.num_kv_heads, cfg.head_dim)
        x = constrain(x, common.ACTIVATION_EMBED, cfg)
        q = DenseGeneral(
            (cfg.d_model,), q_shape, ("embed", "heads", "head_dim"), **dense, name="q"
        )(x)
        k = DenseGeneral(
            (cfg.d_model,), kv_shape, ("embed", "kv_heads", "head_dim"), **dense, name="k"
        )(x)
        v = DenseGeneral(
            (cfg.d_model,), kv_shape, ("embed", "kv_heads", "head_dim"), **dense, name="v"
        )(x)
        q = common.apply_rope(q, positions, cfg.rope_base)
        k = common.apply_rope(k, positions, cfg.rope_base)
        k, v, mask = KVCache(cfg, name="kv_cache")(k, v, segment_ids, mode)
        out = common.dot_product_attention(q, k, v, mask, cfg.dtype)
        out = DenseGeneral(
            q_shape, (cfg.d_model,), ("heads", "head_dim", "embed"), **dense, name="o"
        )(out)
        return constrain(out, common.ACTIVATION_EMBED, cfg)


class Mlp(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``x`` ``[b, s, d_model]``."""
        cfg = self.config
        dense = {
            "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype,
            "aqt_mode": cfg.aqt_mode,
            "fp8": cfg.fp8,
        }
        up_names = ("embed", "mlp")
        gate = DenseGeneral((cfg.d_model,), (cfg.mlp_dim,), up_names, **dense, name="gate")(x)
        up = DenseGeneral((cfg.d_model,), (cfg.mlp_dim,), up_names, **dense, name="up")(x)
        down = DenseGeneral((cfg.mlp_dim,), (cfg.d_model,), ("mlp", "embed"), **dense, name="down")
        return down(constrain(jax.nn.silu(gate) * up, common.ACTIVATION_MLP, cfg))


class Block(nn.Module):
    """One pre-RMSNorm decoder block.

    Returns ``(x, x)`` so the same module serves as an ``nn.scan`` body (carry, output).
    """

    config: TransformerConfig
    feed_forward: ClassVar[type[nn.Module]] = Mlp
    """The module class built from ``config`` as ``mlp`` (a subclass may swap it)."""

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        deterministic: bool,
        mode: str,
    ) -> tuple[jax.Array, jax.Array]:
        """Apply attention and MLP with residuals; dropout only when not deterministic."""
        cfg = self.config
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        h = RMSNorm(**norm, name="attn_norm")(x)
        h = Attention(cfg, name="attn")(h, positions, segment_ids, mode)
        if cfg.dropout_rate > 0:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        x = x + h
        h = RMSNorm(**norm, name="mlp_norm")(x)
        h = self.feed_forward(cfg, name="mlp")(h)
        if cfg.dropout_rate > 0:
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        x = x + h
        return x, x


class Llama(nn.Module):
    """Llama-style decoder returning logits ``[batch, seq, vocab]`` in ``config.dtype``.

    Sows the stacked block outputs ``[num_layers, batch, seq, d_model]`` as
    ``intermediates/hidden_states``.
    """

    config: TransformerConfig
    block: ClassVar[type[nn.Module]] = Block
    """The decoder block class, ``config.num_layers`` times (a subclass may swap it)."""

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
        x = Embed(
            cfg.vocab_size,
            cfg.d_model,
            ("vocab", "embed"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="token_embed",
        )(tokens)
        x = constrain(x, common.ACTIVATION_EMBED, cfg)
        x, hidden_states = apply_layers(
            self.block, cfg, x, positions, segment_ids, deterministic=deterministic, mode=mode
        )
        if mode == "forward":
            self.sow("intermediates", "hidden_states", hidden_states)

        x = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="final_norm")(x)
        head = DenseGeneral(
            (cfg.d_model,),
            (cfg.vocab_size,),
            ("embed", "vocab"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
            name="lm_head",
        )
        if targets is not None:
            return common.tiled_token_loss(head, x, targets, target_weights, cfg.vocab_tiles)
        return constrain(head(x), common.ACTIVATION_VOCAB, cfg)
