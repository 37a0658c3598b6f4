"""Faults in what a program costs, each with numbers equal to Linen's."""

from __future__ import annotations

import dataclasses

from conformance_models import nnx_layers
from conformance_models.llama.family import LlamaFamily
from tests.faults.fault import Fault, Llama

_cache_init = nnx_layers.KVCache.init


def _replicated_kv_cache(self, batch_size, stacked=None):
    """NNX ``KVCache.init`` whose keys and values are replicated, not sharded like Linen's."""
    _cache_init(self, batch_size, stacked)
    for cache in (self.key, self.value):
        cache.set_metadata(out_sharding=(None,) * cache[...].ndim)


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
    Fault(
        Llama(),
        "cost",
        ("NNX costs more than Linen on mesh", "decode_step: "),
        model_patch=(nnx_layers.KVCache, "init", _replicated_kv_cache),
        mesh_axes=("data",),
    ),
)
"""Faults of the cost check."""
