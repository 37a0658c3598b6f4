"""The ``llama`` family: a Llama-style decoder written for Linen and for NNX."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from conformance.families import Batch, Capabilities, Family, LogicalRules, PathRules
from models.common import LOGICAL_AXIS_RULES
from models.config import TransformerConfig
from models.data import make_batch
from models.llama import linen_model, nnx_model

_SIZES: dict[str, TransformerConfig] = {
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
"""Base configs per size; :meth:`LlamaFamily.config` sets the layout and dtype."""


class LlamaFamily(Family):
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head."""

    name = "llama"
    sizes = ("tiny", "8b")
    capabilities = Capabilities(scan_layers=(False, True))

    def config(
        self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32
    ) -> TransformerConfig:
        """Return the ``tiny`` or ``8b`` config with the given layer layout and dtype."""
        if size not in _SIZES:
            raise ValueError(f"llama has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return dataclasses.replace(_SIZES[size], scan_layers=scan_layers, dtype=dtype)

    def linen_module(self, config: TransformerConfig) -> linen_model.Llama:
        """Return the Linen decoder."""
        return linen_model.Llama(config)

    def nnx_module(self, config: TransformerConfig, rngs: nnx.Rngs) -> nnx_model.Llama:
        """Return the NNX decoder initialised from ``rngs``."""
        return nnx_model.Llama(config, rngs=rngs)

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
