"""The plumbing shared by the built-in decoder families."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from conformance.families import (
    Aqt,
    Backend,
    Batch,
    Bridges,
    Decode,
    Divergence,
    Dropout,
    ExplicitSharding,
    Family,
    Feature,
    Fp8,
    Layouts,
    LogicalRules,
    PathRules,
    Qwix,
    Recorded,
    Remat,
    TreeMode,
    VocabTiling,
)
from conformance_models import GOLDENS
from conformance_models.common import LOGICAL_AXIS_RULES
from conformance_models.config import TransformerConfig
from conformance_models.data import make_batch


class TransformerFamily(Family):
    """A decoder family built from a :class:`TransformerConfig` per size.

    A subclass names itself and sets ``sizes``, ``base_configs`` (the config of each
    size) and the Linen and NNX decoder classes, each built from a config.
    """

    goldens = GOLDENS

    train_rngs = ("dropout",)
    known_divergences = (
        Divergence(
            "cost",
            "on explicit axes the built-ins gather each weight whole over the axes its input "
            "is not split over before contracting it (nnx_layers.gathered: FSDP gathers "
            "weights), where on auto axes XLA keeps some contractions on sharded weights and "
            "moves activations instead (all-to-all, collective-permute): on "
            "data=2,fsdp=2,tensor=2 at the tiny size the explicit side holds 1.10-1.20x the "
            "temporary memory in the forward and train step, and its decode step 1.30-1.36x "
            "the temporaries and 1.22-1.35x the bytes accessed, with fewer collectives",
            {"pair": "auto-vs-explicit"},
            shows=r"temp_bytes NNX explicit sharding [\d,]+ > [\d.]+ x NNX auto sharding",
        ),
    )
    base_configs: ClassVar[Mapping[str, TransformerConfig]]
    """Base config per size; :meth:`config` sets the layout and dtype."""
    linen_decoder: ClassVar[type[nn.Module]]
    nnx_decoder: ClassVar[type[nnx.Module]]

    def features(self) -> Sequence[Feature]:
        """Layouts, decoding, remat, dropout, AQT, FP8, vocab tiling, Qwix, tree mode and the rest.

        Decoding takes the ``mode`` keyword, through caches the models hold.
        """
        return (
            Layouts((False, True), self.stack_rules),
            Decode(),
            Remat(self.remat_config),
            Dropout(self.dropout_config),
            Aqt(self.aqt_config),
            Fp8(self.fp8_config),
            VocabTiling(self.vocab_tiling_config),
            Qwix(
                frozenset({"qat_int8", "qat_fp8", "ptq_int8", "ptq_fp8"}), self.quantization_scope
            ),
            Recorded((Backend.LINEN,)),
            Bridges(linen=0, nnx=0),
            TreeMode(),
            ExplicitSharding(),
        )

    def config(
        self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32
    ) -> TransformerConfig:
        """Return the config of ``size`` with the given layer layout and dtype."""
        if size not in self.base_configs:
            raise ValueError(f"{self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return dataclasses.replace(self.base_configs[size], scan_layers=scan_layers, dtype=dtype)

    def train_kwargs(self, config: TransformerConfig) -> Mapping[str, Any]:
        """Train with dropout enabled (applied only when the config's rate is nonzero)."""
        del config
        return {"deterministic": False}

    def remat_config(self, config: TransformerConfig) -> TransformerConfig:
        """``config`` with ``nn.remat``/``nnx.remat`` around each block (no dropout)."""
        return dataclasses.replace(config, remat=True, dropout_rate=0.0)

    def dropout_config(self, config: TransformerConfig, rate: float) -> TransformerConfig:
        """``config`` with dropout at ``rate``."""
        return dataclasses.replace(config, dropout_rate=rate)

    def sequence_length(self, config: TransformerConfig) -> int:
        """``config.max_seq_len``."""
        return config.max_seq_len

    def aqt_config(self, config: TransformerConfig, mode: str) -> TransformerConfig:
        """``config`` with every projection running through AQT int8 in ``mode``."""
        return dataclasses.replace(config, aqt_mode=mode)

    def fp8_config(self, config: TransformerConfig) -> TransformerConfig:
        """``config`` with every projection in FP8 (Flax's delayed-scaling ops)."""
        return dataclasses.replace(config, fp8=True)

    def vocab_tiling_config(self, config: TransformerConfig, tiles: int) -> TransformerConfig:
        """``config`` whose training loss computes the output head ``tiles`` slices at a time."""
        return dataclasses.replace(config, vocab_tiles=tiles)

    def linen_module(self, config: TransformerConfig) -> nn.Module:
        """Return the Linen decoder."""
        return self.linen_decoder(config)

    def nnx_module(self, config: TransformerConfig, rngs: nnx.Rngs) -> nnx.Module:
        """Return the NNX decoder initialised from ``rngs``."""
        return self.nnx_decoder(config, rngs=rngs)

    def batch(self, config: TransformerConfig, batch_size: int, seed: int = 0) -> Batch:
        """Return a padded batch of ``config.max_seq_len`` tokens per row."""
        return make_batch(config.vocab_size, config.max_seq_len, batch_size, seed)

    def path_rules(self, config: TransformerConfig) -> PathRules:
        """Map Linen's ``layers_<i>/`` to NNX's ``layers/<i>/``; nothing when scanned."""
        return () if config.scan_layers else ((r"^layers_(\d+)/", r"layers/\1/"),)

    def stack_rules(self, config: TransformerConfig) -> PathRules:
        """Stack the list's ``layers/<i>/`` leaves into the scanned ``layers/`` layout."""
        del config
        return ((r"^layers/(?P<layer>\d+)/", "layers/"),)

    def logical_axis_rules(self) -> LogicalRules:
        """Return :data:`conformance_models.common.LOGICAL_AXIS_RULES`."""
        return LOGICAL_AXIS_RULES

    def with_mesh(self, config: TransformerConfig, mesh: jax.sharding.Mesh) -> TransformerConfig:
        """``config`` whose modules constrain their activations on ``mesh``.

        By :meth:`logical_axis_rules`, each rule keeping only the mesh axes ``mesh`` has
        (``tensor`` on an ``fsdp=8`` mesh constrains nothing).
        """
        rules = tuple((name, _on(target, mesh)) for name, target in self.logical_axis_rules())
        return dataclasses.replace(config, mesh=mesh, rules=rules)


def _on(target: Any, mesh: jax.sharding.Mesh) -> Any:
    """A rule's mesh axes that ``mesh`` has: a name, a tuple of names, or ``None``."""
    kept = tuple(
        a for a in ((target,) if isinstance(target, str) else target or ()) if a in mesh.axis_names
    )
    return None if not kept else kept[0] if isinstance(target, str) else kept
