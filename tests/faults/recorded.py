"""Faults a recorded reference must catch: a live backend that no longer computes as recorded.

Each is planted in the live NNX side only, and compared with the built-in family's
reference recorded from Linen; the report must name the recording it was compared with.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from conformance.families import PersistentState, with_features
from conformance_models import nnx_layers
from conformance_models.gpt3.family import Gpt3Family
from tests.faults.decode import _index_off_by_one
from tests.faults.fault import Fault, Llama
from tests.faults.forward import Bfloat16OnlyEpsilon, NormEpsilon
from tests.faults.quantization import QuantizesOnlyFirstNnxBlock
from tests.faults.training import StrayCounterBesideRngs, unmasked_loss


class NormStat(nnx.Variable):
    """A persistent, non-parameter Variable type (as MaxText's ``MoEBiasVar`` is)."""


class ScaleLeftParams(Gpt3Family):
    """NNX keeps the final LayerNorm's scale as a declared ``NormStat``, no longer a Param.

    The forward still computes the same, and a resume restores the recorded scale into the
    ``NormStat``; but the scale is no longer trained, so the steps after drift from the
    recording, and the report names the leaf that changed collection.
    """

    def features(self):
        return with_features(super().features(), PersistentState(lambda: (NormStat,)))

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        scale = model.final_norm.scale
        model.final_norm.scale = NormStat(scale[...], **scale.get_metadata())
        return model


_AGAINST = "NNX vs recorded Linen (flax "
_NNX = {"backend": "nnx"}

FAULTS = (
    Fault(
        NormEpsilon(),
        "recorded_forward",
        (_AGAINST, "float32 forward on one device", "logits:", "verdict: NNX on one device"),
        params=_NNX,
    ),
    Fault(
        Llama(),
        "recorded_train_step",
        (_AGAINST, "train, step 1 of 3 on one device", "loss:"),
        seams={"nnx_loss": unmasked_loss},
        params=_NNX,
    ),
    Fault(
        Llama(),
        "recorded_train_step",
        (
            _AGAINST,
            "train, step 1 of 3 on one device (bfloat16 compute)",
            "grads/lm_head/kernel:",
            "differ more than rounding moves them",
        ),
        seams={"nnx_loss": unmasked_loss},
        params=_NNX,
        dtype=jnp.bfloat16,
    ),
    Fault(
        Bfloat16OnlyEpsilon(),
        "recorded_train_step",
        (
            _AGAINST,
            "train, step 1 of 3 on one device (bfloat16 compute)",
            "grads/layers/1/mlp_norm/scale:",
            "differ more than rounding moves them",
        ),
        params=_NNX,
        dtype=jnp.bfloat16,
    ),
    Fault(
        StrayCounterBesideRngs(),
        "recorded_resume",
        (
            "NNX cannot resume from recorded Linen",
            "model/calls: in the live state, but not recorded",
        ),
        params=_NNX,
    ),
    Fault(
        ScaleLeftParams(),
        "recorded_resume",
        (
            "resumed from the recorded step 1, step 3 of 3",
            "changed collection: final_norm/scale: a parameter when recorded, NormStat "
            "(persistent state, not trained) now",
        ),
        params=_NNX,
    ),
    Fault(
        Bfloat16OnlyEpsilon(),
        "recorded_resume",
        (
            _AGAINST,
            "resumed from the recorded step 1, step 2 of 3 on one device (bfloat16 compute)",
            "differ more than rounding moves them",
        ),
        params=_NNX,
        dtype=jnp.bfloat16,
    ),
    Fault(
        Llama(),
        "recorded_decode",
        (_AGAINST, "prefill and decode on one device", "steps:"),
        model_patch=(nnx_layers.KVCache, "__call__", _index_off_by_one),
        params=_NNX,
    ),
    Fault(
        QuantizesOnlyFirstNnxBlock(),
        "recorded_quant_forward",
        (_AGAINST, "qat_int8 forward on one device", "logits:"),
        quant="qat_int8",
        params=_NNX,
    ),
)
"""Faults of the recorded_* checks."""
