"""Planted faults: deliberate divergences, each injected into one side, by area.

Each area module (:mod:`tests.faults.structure`, ``forward``, ``precision``, ``activations``,
``training``, ``state``, ``decode``, ``quantization``, ``checkpoints``, ``recorded``,
``cost``, ``tpu``, ``modes``) pairs its faults with the check that must catch them and the words
(leaf path first) the failure report must contain.
"""

from __future__ import annotations

from tests.faults import (
    activations,
    checkpoints,
    cost,
    decode,
    forward,
    modes,
    precision,
    quantization,
    recorded,
    state,
    structure,
    tpu,
    training,
)
from tests.faults.fault import Fault

FAULTS: tuple[Fault, ...] = (
    *structure.FAULTS,
    *forward.FAULTS,
    *precision.FAULTS,
    *training.FAULTS,
    *state.FAULTS,
    *decode.FAULTS,
    *quantization.FAULTS,
    *checkpoints.FAULTS,
    *recorded.FAULTS,
    *cost.FAULTS,
    *activations.FAULTS,
    *tpu.FAULTS,
    *modes.FAULTS,
)
"""Every planted fault, by area."""
