"""The configuration shared by the built-in transformer families."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of a decoder-only transformer, the same for Linen and NNX.

    ``dtype`` is the compute dtype (float32 or bfloat16); ``param_dtype`` the dtype
    parameters are stored in. ``rope_base`` is used by llama and ignored by gpt3. With
    ``aqt_mode`` every projection runs through AQT (see :mod:`conformance_models.aqt`).
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int
    scan_layers: bool
    remat: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    norm_eps: float = 1e-5
    rope_base: float = 10_000.0
    dropout_rate: float = 0.0
    aqt_mode: str | None = None
    """``None`` (float projections) or an AQT int8 mode: ``train``, ``convert`` or ``serve``."""
    fp8: bool = False
    """Every projection computes in FP8 through Flax's delayed-scaling ops
    (``nn.Fp8DirectDotGeneralOp``; bridged into NNX)."""
    vocab_tiles: int = 1
    """Slices a training call given ``targets`` computes its logits and loss in."""
    mesh: Any = None
    """The device mesh activations are constrained on (``None``: not constrained)."""
    rules: tuple[tuple[str, Any], ...] = ()
    """The logical-axis rules activation constraints resolve by, on :attr:`mesh`."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.vocab_tiles < 1:
            raise ValueError(f"vocab_tiles must be at least 1, got {self.vocab_tiles}")
        if self.fp8 and self.aqt_mode is not None:
            raise ValueError("fp8 and aqt_mode are two ways to quantize: choose one")
        if self.aqt_mode not in (None, "train", "convert", "serve"):
            raise ValueError(
                f"aqt_mode must be None, 'train', 'convert' or 'serve', got {self.aqt_mode!r}"
            )
