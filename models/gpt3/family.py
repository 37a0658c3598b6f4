"""The ``gpt3`` family: a GPT-3-style decoder written for Linen and for NNX."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from conformance.families import Batch, Capabilities, Family, LogicalRules, PathRules
from models.common import LOGICAL_AXIS_RULES
from models.config import TransformerConfig
from models.data import make_batch
from models.gpt3 import linen_model, nnx_model

_SIZES: dict[str, TransformerConfig] = {
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
"""Base configs per size; :meth:`Gpt3Family.config` sets the layout and dtype."""


class Gpt3Family(Family):
    """GPT-3-style decoder: learned positions, LayerNorm, fused QKV, GELU, tied logits."""

    name = "gpt3"
    sizes = ("tiny", "6b")
    capabilities = Capabilities(scan_layers=(False, True))

    def config(
        self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32
    ) -> TransformerConfig:
        """Return the ``tiny`` or ``6b`` config with the given layer layout and dtype."""
        if size not in _SIZES:
            raise ValueError(f"gpt3 has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return dataclasses.replace(_SIZES[size], scan_layers=scan_layers, dtype=dtype)

    def linen_module(self, config: TransformerConfig) -> linen_model.Gpt3:
        """Return the Linen decoder."""
        return linen_model.Gpt3(config)

    def nnx_module(self, config: TransformerConfig, rngs: nnx.Rngs) -> nnx_model.Gpt3:
        """Return the NNX decoder initialised from ``rngs``."""
        return nnx_model.Gpt3(config, rngs=rngs)

    def batch(self, config: TransformerConfig, batch_size: int, seed: int = 0) -> Batch:
        """Return a padded batch of ``config.max_seq_len`` tokens per row."""
        return make_batch(config.vocab_size, config.max_seq_len, batch_size, seed)

    def path_rules(self, config: TransformerConfig) -> PathRules:
        """Map Linen's ``layers_<i>/`` to NNX's ``layers/<i>/``; nothing when scanned."""
        return () if config.scan_layers else ((r"^layers_(\d+)/", r"layers/\1/"),)

    def layer_stack_rules(self, config: TransformerConfig) -> PathRules:
        """Stack Linen's ``layers_<i>/`` leaves into the scanned ``layers/`` layout."""
        del config
        return ((r"^layers_(?P<layer>\d+)/", "layers/"),)

    def logical_axis_rules(self) -> LogicalRules:
        """Return :data:`models.common.LOGICAL_AXIS_RULES`."""
        return LOGICAL_AXIS_RULES
