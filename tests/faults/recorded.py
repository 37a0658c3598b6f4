"""Faults a recorded reference must catch: a live backend that no longer computes as recorded.

Each is planted in the live NNX side only, and compared with the built-in family's
reference recorded from Linen; the report must name the recording it was compared with.
"""

from __future__ import annotations

from conformance_models import nnx_layers
from tests.faults.decode import _index_off_by_one
from tests.faults.fault import Fault, Llama
from tests.faults.forward import NormEpsilon
from tests.faults.quantization import QuantizesOnlyFirstNnxBlock
from tests.faults.training import StrayCounterBesideRngs, unmasked_loss

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
        StrayCounterBesideRngs(),
        "recorded_resume",
        (
            "NNX cannot resume from recorded Linen",
            "model/calls: in the live state, but not recorded",
        ),
        params=_NNX,
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
