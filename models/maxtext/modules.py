"""MaxText's two Transformers, wrapped to the harness's module conventions.

Only the call signature changes: ``(tokens, positions, segment_ids, deterministic=...)``
becomes MaxText's ``(decoder_input_tokens, decoder_positions, decoder_segment_ids,
enable_dropout=...)``. The wrappers subclass MaxText's classes, so parameter paths are
MaxText's own (``token_embedder/...``, ``decoder/...``) on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from maxtext.common.common_types import MODEL_MODE_TRAIN
from maxtext.layers import quantizations
from maxtext.models.models import Transformer, TransformerLinenPure
from maxtext.utils import maxtext_utils

from conformance_models.maxtext.config import MaxTextConfig, hyperparameters


def _mesh_and_quant(config: MaxTextConfig, hp: Any) -> tuple[jax.sharding.Mesh, Any]:
    mesh = config.mesh if config.mesh is not None else maxtext_utils.get_mesh_from_config(hp)
    return mesh, quantizations.configure_quantization(hp)


class LinenTransformer(TransformerLinenPure):
    """MaxText's pure Linen Transformer with the harness's call signature."""

    def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``init`` that also gives a ``dropout`` stream when given a single key.

        With dropout on, MaxText's DeepSeek layers draw a dropout key even while
        initialising deterministically, and Linen has no default stream to fall back to.
        """
        if not isinstance(rngs, Mapping):
            rngs = {"params": rngs, "dropout": jax.random.fold_in(rngs, 1)}
        return super().init(rngs, *args, **kwargs)

    def __call__(  # type: ignore[override]
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        deterministic: bool = True,
        model_mode: str = MODEL_MODE_TRAIN,
    ) -> jax.Array:
        """Logits ``[batch, seq, vocab]``; dropout only when not ``deterministic``."""
        return super().__call__(
            tokens,
            positions,
            segment_ids,
            enable_dropout=not deterministic,
            model_mode=model_mode,
        )


class NnxTransformer(Transformer):
    """MaxText's NNX Transformer with the harness's call signature."""

    def __call__(  # type: ignore[override]
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        deterministic: bool = True,
    ) -> jax.Array:
        """Logits ``[batch, seq, vocab]``; dropout only when not ``deterministic``."""
        return super().__call__(tokens, positions, segment_ids, enable_dropout=not deterministic)


def linen_transformer(config: MaxTextConfig) -> LinenTransformer:
    """The Linen side of ``config``, built as MaxText's ``from_config`` builds it."""
    hp = hyperparameters(config, "linen")
    mesh, quant = _mesh_and_quant(config, hp)
    return LinenTransformer(hp, mesh, quant)


def nnx_transformer(config: MaxTextConfig, rngs: nnx.Rngs) -> NnxTransformer:
    """The NNX side of ``config``, built as MaxText's ``from_config`` builds it."""
    hp = hyperparameters(config, "nnx")
    mesh, quant = _mesh_and_quant(config, hp)
    return NnxTransformer(hp, mesh, quant, rngs=rngs)
