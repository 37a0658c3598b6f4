"""maxtext 0.2.4's pure Linen ``TransformerLinenPure`` with the harness's call signature.

0.2.4 is the last release with a Linen implementation of its own; see
:mod:`conformance_models.maxtext.modules` for the conventions both sides share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_TRAIN
from maxtext.models.models import TransformerLinenPure
from maxtext.utils.vocabulary_tiling import vocab_tiling_linen_loss

from conformance_models.maxtext.config import MaxTextConfig, hyperparameters
from conformance_models.maxtext.modules import (
    call_maxtext,
    check_cache_rows,
    maxtext_mode,
    mesh_and_quant,
)


class LinenTransformer(TransformerLinenPure):
    """MaxText's pure Linen Transformer with the harness's call signature."""

    def init(self, rngs: Any, *args: Any, mode: str = "forward", **kwargs: Any) -> Any:  # type: ignore[override]
        """``init`` that also gives a ``dropout`` stream when given a single key.

        With dropout on, MaxText's DeepSeek layers draw a dropout key even while
        initialising deterministically, and Linen has no default stream to fall back to.
        With ``mode="prefill"`` the variables include an empty ``cache`` collection for
        the rows of ``args``: MaxText creates it by an autoregressive init.
        """
        if not isinstance(rngs, Mapping):
            rngs = {"params": rngs, "dropout": jax.random.fold_in(rngs, 1)}
        if maxtext_mode(mode) == MODEL_MODE_TRAIN:
            return super().init(rngs, *args, **kwargs)
        tokens, positions, *_ = args
        check_cache_rows(self.config, tokens.shape[0])
        return super().init(
            rngs, tokens[:, :1], positions[:, :1], None, model_mode=MODEL_MODE_AUTOREGRESSIVE
        )

    def apply(  # type: ignore[override]
        self,
        variables: Any,
        *args: Any,
        mode: str = "forward",
        targets: jax.Array | None = None,
        target_weights: jax.Array | None = None,
        **kwargs: Any,
    ) -> Any:
        """``apply`` in the harness's ``mode`` (MaxText's ``model_mode``).

        With ``targets``, a training forward whose loss MaxText's trainer computes:
        with ``num_vocab_tiling > 1`` the decoder sows its final hidden states instead
        of returning logits, and ``vocab_tiling_linen_loss`` reduces them to the
        summed weighted cross entropy, which is returned, with the sown collections
        beside it when the caller asks for any (``mutable``), as ``apply`` returns them.
        """
        if targets is None:
            return super().apply(variables, *args, model_mode=maxtext_mode(mode), **kwargs)
        asked = kwargs.pop("mutable", False)
        mutable = ["intermediates", *(c for c in asked or () if c != "intermediates")]
        _, sown = super().apply(
            variables, *args, model_mode=MODEL_MODE_TRAIN, mutable=mutable, **kwargs
        )
        hidden = sown["intermediates"]["decoder"]["hidden_states"][0]
        data = {"targets": targets, "targets_segmentation": target_weights}
        loss, _ = vocab_tiling_linen_loss(hidden, data, self.config, self, variables, True)
        return (loss, sown) if asked else loss

    def __call__(  # type: ignore[override]
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        deterministic: bool = True,
        model_mode: str = MODEL_MODE_TRAIN,
    ) -> jax.Array:
        """Logits ``[batch, seq, vocab]``; dropout only when not ``deterministic``."""
        call = super().__call__
        return call_maxtext(call, tokens, positions, segment_ids, deterministic, model_mode)


def linen_transformer(config: MaxTextConfig) -> LinenTransformer:
    """The Linen side of ``config``, built as MaxText's ``from_config`` builds it."""
    hp = hyperparameters(config, "linen")
    mesh, quant = mesh_and_quant(config, hp)
    return LinenTransformer(hp, mesh, quant)
