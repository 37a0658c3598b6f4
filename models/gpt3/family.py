"""The ``gpt3`` family: a GPT-3-style decoder written for Linen and for NNX."""

from __future__ import annotations

from typing import ClassVar

from conformance_models.config import TransformerConfig
from conformance_models.gpt3 import linen_model, nnx_model
from conformance_models.transformer_family import TransformerFamily


class Gpt3Family(TransformerFamily):
    """GPT-3-style decoder: learned positions, LayerNorm, fused QKV, GELU, tied logits."""

    name = "gpt3"
    base_configs: ClassVar[dict[str, TransformerConfig]] = {
        "tiny": TransformerConfig(
            vocab_size=256,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            head_dim=16,
            mlp_dim=256,
            max_seq_len=32,
            scan_layers=False,
            norm_eps=1e-5,
        ),
        "6b": TransformerConfig(
            vocab_size=50304,
            d_model=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            mlp_dim=16384,
            max_seq_len=2048,
            scan_layers=False,
            norm_eps=1e-5,
        ),
    }
    sizes = tuple(base_configs)
    linen_decoder = linen_model.Gpt3
    nnx_decoder = nnx_model.Gpt3
