"""MaxText's NNX Transformer in the harness's module conventions, and the Linen sides' helpers.

The Linen sides are :mod:`~conformance_models.maxtext.pure_linen` (maxtext 0.2.4) and
:mod:`~conformance_models.maxtext.bridged_linen` (from 0.2.5).

Only the call signature changes: ``(tokens, positions, segment_ids, deterministic=...,
mode=...)`` becomes MaxText's ``(decoder_input_tokens, decoder_positions,
decoder_segment_ids, enable_dropout=..., model_mode=...)``. The wrappers subclass
MaxText's classes, so parameter and cache paths are MaxText's own
(``token_embedder/...``, ``decoder/...``) on both sides.

Serving follows MaxText's own decode loop: a batch of right-padded prompts is prefilled
(``model_mode="prefill"``, segment id 0 masks the padding) and then every row steps
together (``"autoregressive"``, each row at its own position, no segment ids). MaxText
sizes its KV caches for the configured decode batch only when a model is *built* for
autoregressive decoding, so both sides create their caches that way.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from aqt.jax.v2 import config as aqt_config
from flax import nnx
from maxtext.common.common_types import (
    MODEL_MODE_AUTOREGRESSIVE,
    MODEL_MODE_PREFILL,
    MODEL_MODE_TRAIN,
)
from maxtext.layers import quantizations
from maxtext.models.models import Transformer
from maxtext.utils import maxtext_utils
from maxtext.utils.vocabulary_tiling import vocab_tiling_nnx_loss

from conformance_models.maxtext.config import MaxTextConfig, hyperparameters

_MODEL_MODES: Mapping[str, str] = {
    "forward": MODEL_MODE_TRAIN,
    "prefill": MODEL_MODE_PREFILL,
    "decode": MODEL_MODE_AUTOREGRESSIVE,
}
"""The harness's call modes and MaxText's ``model_mode`` for each."""


def maxtext_mode(mode: str) -> str:
    """MaxText's ``model_mode`` for the harness's call ``mode``; a clear error for another."""
    if mode not in _MODEL_MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(_MODEL_MODES)}")
    return _MODEL_MODES[mode]


def check_cache_rows(config: Any, rows: int) -> None:
    """MaxText's caches hold ``per_device_batch_size`` x devices rows, fixed at build."""
    expected = config.micro_batch_size_to_train_on
    if rows != expected:
        raise ValueError(
            f"MaxText builds its KV caches for {expected} rows (per_device_batch_size x "
            f"devices), not {rows}"
        )


def _quantization(config: MaxTextConfig, hp: Any) -> Any:
    """MaxText's own quantization for ``hp``; for AQT, its int8 recipe without noise.

    MaxText's int8 recipe rounds the activation gradient stochastically from a key each
    backend draws differently; the same recipe with round-to-nearest keeps the two
    comparable (the layers accept any quantization object).
    """
    if not config.aqt_mode:
        return quantizations.configure_quantization(hp)
    quant = quantizations.configure_quantization(hp, quant_mode_str=config.aqt_mode)
    recipe = copy.deepcopy(quant.quant_dg)
    aqt_config.set_stochastic_rounding(
        recipe,
        vjp_lhs_stochastic_rounding=False,
        vjp_rhs_stochastic_rounding=False,
        implementation="jax.uniform",
    )
    return dataclasses.replace(quant, quant_dg=recipe)


def call_maxtext(
    call: Any,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    deterministic: bool,
    model_mode: str,
) -> jax.Array:
    """``call`` with MaxText's arguments: no segment ids in autoregressive steps."""
    if model_mode == MODEL_MODE_AUTOREGRESSIVE:
        segment_ids = None  # MaxText raises when given them there
    return call(
        tokens, positions, segment_ids, enable_dropout=not deterministic, model_mode=model_mode
    )


def mesh_and_quant(config: MaxTextConfig, hp: Any) -> tuple[jax.sharding.Mesh, Any]:
    """The mesh and quantization MaxText's ``from_config`` gives a model of ``config``."""
    mesh = config.mesh if config.mesh is not None else maxtext_utils.get_mesh_from_config(hp)
    return mesh, _quantization(config, hp)


class NnxTransformer(Transformer):
    """MaxText's NNX Transformer with the harness's call signature."""

    def __call__(  # type: ignore[override]
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        deterministic: bool = True,
        mode: str = "forward",
        targets: jax.Array | None = None,
        target_weights: jax.Array | None = None,
    ) -> jax.Array:
        """Logits ``[batch, seq, vocab]``; dropout only when not ``deterministic``.

        With ``targets``, the summed weighted cross entropy as MaxText's trainer
        computes it with ``num_vocab_tiling > 1``: the decoder sows its final hidden
        states and ``vocab_tiling_nnx_loss`` reduces them.
        """
        call = super().__call__
        if targets is None:
            model_mode = maxtext_mode(mode)
            return call_maxtext(call, tokens, positions, segment_ids, deterministic, model_mode)
        capturing = nnx.capture(call, nnx.Intermediate)
        _, sown = call_maxtext(
            capturing, tokens, positions, segment_ids, deterministic, MODEL_MODE_TRAIN
        )
        (hidden,) = sown["decoder"]["hidden_states"].get_value()
        data = {"targets": targets, "targets_segmentation": target_weights}
        loss, _ = vocab_tiling_nnx_loss(self, hidden, data, self.config, True)
        return loss

    def init_cache(self, batch_size: int) -> None:  # type: ignore[override]
        """Give every attention layer an empty KV cache for ``batch_size`` rows.

        MaxText's own ``init_cache`` is a stub, and its ``nnx.Cache`` variables exist
        only in a model built for autoregressive decoding; so the decoder is rebuilt
        that way, keeping its parameters and other persistent state (maxtext 0.2.5's
        ``MoEBiasVar``).
        """
        check_cache_rows(self.config, batch_size)
        mode = MODEL_MODE_AUTOREGRESSIVE
        serving = Transformer(self.config, self.mesh, self.quant, model_mode=mode, rngs=nnx.Rngs(0))
        kept = nnx.Not(nnx.Any(nnx.Cache, nnx.RngState))
        nnx.update(serving.decoder, nnx.state(self.decoder, kept))
        self.decoder = serving.decoder
        self.model_mode = mode


def nnx_transformer(config: MaxTextConfig, rngs: nnx.Rngs) -> NnxTransformer:
    """The NNX side of ``config``, built as MaxText's ``from_config`` builds it."""
    hp = hyperparameters(config, "nnx")
    mesh, quant = mesh_and_quant(config, hp)
    return NnxTransformer(hp, mesh, quant, rngs=rngs)
