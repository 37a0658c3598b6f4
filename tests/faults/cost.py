"""Faults in what a program costs, each with numbers equal to Linen's."""

from __future__ import annotations

import dataclasses

from conformance_models.llama.family import LlamaFamily
from tests.faults.fault import Fault


class NnxDropsRemat(LlamaFamily):
    """NNX ignores ``remat``: the same numbers, every block's activations kept for backward."""

    def nnx_module(self, config, rngs):
        return super().nnx_module(dataclasses.replace(config, remat=False), rngs)


class NnxReplicatesKernel(LlamaFamily):
    """NNX replicates block 0's MLP down projection, which Linen shards."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.down.kernel.set_metadata(out_sharding=(None, None))
        return model


FAULTS = (
    Fault(
        NnxDropsRemat(),
        "cost",
        ("NNX costs more than Linen on mesh", "train_step (remat): temp_bytes NNX"),
    ),
    Fault(
        NnxReplicatesKernel(),
        "cost",
        ("NNX costs more than Linen on mesh", "train_step: all-"),
        mesh_axes=("fsdp",),
    ),
)
"""Faults of the cost check."""
