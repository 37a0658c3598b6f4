"""maxtext 0.2.5's Linen face: ``TransformerLinen``, a ``ToLinen`` bridge around NNX.

0.2.5 deleted its Linen implementation; what Linen callers (checkpoint conversion, AOT
compilation, the inference engine) get from ``transformer_as_linen`` is
``TransformerLinen``, which builds the NNX ``Transformer`` inside a Linen module. The
harness builds it the same way around :class:`~conformance_models.maxtext.modules.
NnxTransformer` (MaxText's ``Transformer`` with the harness's call signature), so parity
on this release tests the bridge around the NNX model, not a second implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax.core import FrozenDict
from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_TRAIN
from maxtext.layers import initializers
from maxtext.layers.nnx_wrappers import ToLinen
from maxtext.models.models import TransformerLinen

from conformance_models.maxtext.config import MaxTextConfig, hyperparameters
from conformance_models.maxtext.modules import (
    NnxTransformer,
    check_cache_rows,
    maxtext_mode,
    mesh_and_quant,
)


class BridgedTransformer(TransformerLinen):
    """``TransformerLinen`` taking the harness's ``mode`` instead of ``model_mode``.

    The NNX model inside is built for training in a ``forward`` call and for
    autoregressive decoding otherwise (MaxText's KV caches exist only in a model built
    that way), as ``TransformerLinen`` rebuilds it for each ``model_mode``.
    """

    def _for(self, mode: str) -> BridgedTransformer:
        built = (
            MODEL_MODE_TRAIN
            if maxtext_mode(mode) == MODEL_MODE_TRAIN
            else MODEL_MODE_AUTOREGRESSIVE
        )
        return self.clone(kwargs=self.kwargs.copy({"model_mode": built}))

    def init(self, rngs: Any, *args: Any, mode: str = "forward", **kwargs: Any) -> Any:  # type: ignore[override]
        """``init`` that also gives a ``dropout`` stream when given a single key.

        With ``mode="prefill"`` the variables include an empty ``cache`` collection for
        the rows of ``args``, made by an autoregressive init as MaxText makes it.
        """
        if not isinstance(rngs, Mapping):
            rngs = {"params": rngs, "dropout": jax.random.fold_in(rngs, 1)}
        if maxtext_mode(mode) == MODEL_MODE_TRAIN:
            return ToLinen.init(self._for(mode), rngs, *args, **kwargs)
        tokens, positions, *_ = args
        check_cache_rows(self.kwargs["config"], tokens.shape[0])
        first = (tokens[:, :1], positions[:, :1], None)
        return ToLinen.init(self._for(mode), rngs, *first, mode="decode", **kwargs)

    def apply(self, variables: Any, *args: Any, mode: str = "forward", **kwargs: Any) -> Any:  # type: ignore[override]
        """``apply`` in the harness's ``mode``; ``targets`` give the tiled loss as NNX does."""
        return ToLinen.apply(self._for(mode), variables, *args, mode=mode, **kwargs)


def linen_transformer(config: MaxTextConfig) -> BridgedTransformer:
    """The Linen side of ``config``: ``transformer_as_linen``'s bridge, around the harness's NNX."""
    hp = hyperparameters(config, "linen")
    mesh, quant = mesh_and_quant(config, hp)
    return BridgedTransformer(
        NnxTransformer,
        args=(),
        kwargs=FrozenDict(
            {"mesh": mesh, "config": hp, "quant": quant, "model_mode": MODEL_MODE_TRAIN}
        ),
        metadata_fn=initializers.variable_to_logically_partitioned,
    )
