"""Faults in what running an NNX model outside training leaves in its state."""

from __future__ import annotations

import jax.numpy as jnp

from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from tests.faults.fault import Fault, Llama


class IntermediateAtSetUp(LlamaFamily):
    """NNX runs one forward while being built (to check shapes), outside ``nnx.capture``."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        batch = self.batch(config, 1)
        model(batch.tokens, batch.positions, batch.segment_ids)
        return model


_rms_norm_call = llama_nnx.RMSNorm.__call__


def _sows_norm_stats(self, x):
    """RMSNorm that also records its input's scale under a string name, as MaxText did."""
    self.sow("norm_stats", "rms", jnp.sqrt(jnp.mean(jnp.square(x))))
    return _rms_norm_call(self, x)


FAULTS = (
    Fault(
        Llama(),
        "state_hygiene",
        (
            "NNX model state after an eager forward is not the freshly built model's",
            "layers/0/attn_norm/rms: flax.nnx.variablelib.norm_stats appeared",
        ),
        model_patch=(llama_nnx.RMSNorm, "__call__", _sows_norm_stats),
    ),
    Fault(
        IntermediateAtSetUp(),
        "state_hygiene",
        (
            "the freshly built NNX model holds sown intermediates",
            "hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate): a forward "
            "at set-up",
        ),
    ),
)
