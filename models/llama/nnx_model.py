"""Llama-style decoder written with Flax NNX.

Submodules and parameters are named exactly as in :mod:`conformance_models.llama.linen_model`; the
only difference in paths is the unscanned layer list (``layers/0`` here, ``layers_0``
in Linen).
"""

from __future__ import annotations

from typing import Any, ClassVar

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


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale, computed in float32."""

    def __init__(
        self, features: int, *, eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs
    ) -> None:
        self.eps = eps
        self.dtype = dtype
        ones = nnx.with_partitioning(nnx.initializers.ones, ("norm",))
        self.scale = nnx.Param(ones(rngs.params(), (features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise ``x`` and return it in ``dtype``."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE on queries and keys."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.config = cfg
        self.dtype = cfg.dtype
        self.rope_base = cfg.rope_base
        dense: dict[str, Any] = {
            "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype,
            "rngs": rngs,
            "aqt_mode": cfg.aqt_mode,
            "fp8": cfg.fp8,
        }
        q_shape = (cfg.num_heads, cfg.head_dim)
        kv_shape = (cfg.num_kv_heads, cfg.head_dim)
        self.q = DenseGeneral((cfg.d_model,), q_shape, ("embed", "heads", "head_dim"), **dense)
        self.k = DenseGeneral((cfg.d_model,), kv_shape, ("embed", "kv_heads", "head_dim"), **dense)
        self.v = DenseGeneral((cfg.d_model,), kv_shape, ("embed", "kv_heads", "head_dim"), **dense)
        self.kv_cache = KVCache(cfg)
        self.o = DenseGeneral(q_shape, (cfg.d_model,), ("heads", "head_dim", "embed"), **dense)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, mode: str
    ) -> jax.Array:
        """Attend over ``x`` ``[b, s, d_model]``, causally within each segment."""
        x = constrain(x, common.ACTIVATION_EMBED, self.config)
        q = common.apply_rope(self.q(x), positions, self.rope_base)
        k = common.apply_rope(self.k(x), positions, self.rope_base)
        k, v, mask = self.kv_cache(k, self.v(x), segment_ids, mode)
        out = common.dot_product_attention(q, k, v, mask, self.dtype)
        return constrain(self.o(out), common.ACTIVATION_EMBED, self.config)


class Mlp(nnx.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        self.config = cfg
        dense: dict[str, Any] = {
            "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype,
            "rngs": rngs,
            "aqt_mode": cfg.aqt_mode,
            "fp8": cfg.fp8,
        }
        self.gate = DenseGeneral((cfg.d_model,), (cfg.mlp_dim,), ("embed", "mlp"), **dense)
        self.up = DenseGeneral((cfg.d_model,), (cfg.mlp_dim,), ("embed", "mlp"), **dense)
        self.down = DenseGeneral((cfg.mlp_dim,), (cfg.d_model,), ("mlp", "embed"), **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to ``x`` ``[b, s, d_model]``."""
        hidden = jax.nn.silu(self.gate(x)) * self.up(x)
        return self.down(constrain(hidden, common.ACTIVATION_MLP, self.config))


class Block(nnx.Module):
    """One pre-RMSNorm decoder block."""

    feed_forward: ClassVar[type[nnx.Module]] = Mlp
    """The module class built from ``config`` as ``mlp`` (a subclass may swap it)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        cfg = config
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        self.attn_norm = RMSNorm(cfg.d_model, **norm, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm, rngs=rngs)
        self.mlp = self.feed_forward(cfg, rngs=rngs)
        self.dropout: nnx.Dropout | None
        if cfg.dropout_rate > 0:
            self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        else:
            self.dropout = nnx.data(None)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        deterministic: bool,
        mode: str,
    ) -> jax.Array:
        """Apply attention and MLP with residuals; dropout only when not deterministic."""
        h = self.attn(self.attn_norm(x), positions, segment_ids, mode)
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.dropout is not None:
            h = self.dropout(h, deterministic=deterministic)
        return x + h


class Llama(nnx.Module):
    """Llama-style decoder returning logits ``[batch, seq, vocab]`` in ``config.dtype``.

    Sows the stacked block outputs ``[num_layers, batch, seq, d_model]`` as the
    ``nnx.Intermediate`` named ``hidden_states``.
    """

    block: ClassVar[type[nnx.Module]] = Block
    """The decoder block class, ``config.num_layers`` times (a subclass may swap it)."""

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
        self.layers = make_layers(self.block, cfg, rngs)
        self.final_norm = RMSNorm(
            cfg.d_model,
            eps=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.lm_head = DenseGeneral(
            (cfg.d_model,),
            (cfg.vocab_size,),
            ("embed", "vocab"),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            aqt_mode=cfg.aqt_mode,
            fp8=cfg.fp8,
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
        x = constrain(self.token_embed(tokens), common.ACTIVATION_EMBED, self.config)
        x, hidden_states = apply_layers(
            self.layers,
            self.config,
            x,
            positions,
            segment_ids,
            deterministic=deterministic,
            mode=mode,
        )
        if mode == "forward":
            self.sow(nnx.Intermediate, "hidden_states", hidden_states)
        x = self.final_norm(x)
        if targets is not None:
            return common.tiled_token_loss(
                self.lm_head, x, targets, target_weights, self.config.vocab_tiles
            )
        return constrain(self.lm_head(x), common.ACTIVATION_VOCAB, self.config)
