"""The ``llama`` family: a Llama-style decoder written for Linen and for NNX."""

from __future__ import annotations

from typing import ClassVar

from conformance_models.config import TransformerConfig
from conformance_models.llama import linen_model, nnx_model
from conformance_models.transformer_family import TransformerFamily


class LlamaFamily(TransformerFamily):
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head."""

    name = "llama"
    base_configs: ClassVar[dict[str, TransformerConfig]] = {
        "tiny": TransformerConfig(
            vocab_size=256,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=128,
            max_seq_len=32,
            scan_layers=False,
            norm_eps=1e-6,
            rope_base=10_000.0,
        ),
        "8b": TransformerConfig(
            vocab_size=128256,
            d_model=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            mlp_dim=14336,
            max_seq_len=8192,
            scan_layers=False,
            norm_eps=1e-6,
            rope_base=500_000.0,
        ),
    }
    sizes = tuple(base_configs)
    linen_decoder = linen_model.Llama
    nnx_decoder = nnx_model.Llama
