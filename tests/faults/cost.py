"""Faults in what a program costs, each with numbers equal to Linen's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from conformance_models import nnx_layers
from conformance_models.llama import nnx_model as llama_nnx
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
    """NNX replicates block 0's MLP down projection (every block's, scanned), which Linen
    shards."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.scan_layers:  # the layer axis stays first, as the scan needs
            kernel = model.layers.mlp.down.kernel
            layers = kernel.get_metadata()["out_sharding"][0]
            kernel.set_metadata(out_sharding=(layers, None, None))
        else:
            model.layers[0].mlp.down.kernel.set_metadata(out_sharding=(None, None))
        return model


class NnxMovesKernel(LlamaFamily):
    """NNX shards block 0's MLP down projection (every block's, scanned) on the mesh axes
    Linen shards the other dimension on: the same numbers, other collectives."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        layers = model.layers if config.scan_layers else model.layers[0]
        kernel = layers.mlp.down.kernel
        *stack, rows, columns = kernel.get_metadata()["out_sharding"]
        kernel.set_metadata(out_sharding=(*stack, columns, rows))
        return model


class ReadOnlyTable(nnx.Variable):
    """A table the model reads and never trains or updates."""


class _BlockWithTable(llama_nnx.Block):
    """Llama's block reading a per-position table of ones, kept as its own Variable."""

    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        shape = (config.vocab_size, config.d_model)
        self.table = ReadOnlyTable(jnp.ones(shape, config.param_dtype))

    def __call__(self, x, *args, **kwargs):
        table = self.table[...][: x.shape[1]].astype(x.dtype)
        return super().__call__(x * table, *args, **kwargs)


class _LlamaWithTable(llama_nnx.Llama):
    block = _BlockWithTable


class NnxScanStacksReadOnlyTable(LlamaFamily):
    """NNX's scanned blocks each carry a read-only table that Linen would broadcast.

    Created inside the scan's ``vmap``, the table is stacked per layer: the same numbers
    (it holds ones), a copy per layer in every program's arguments.
    """

    nnx_decoder = _LlamaWithTable

    def config(self, size, *, scan_layers, dtype=jnp.float32):
        return super().config(size, scan_layers=True, dtype=dtype)


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
        NnxScanStacksReadOnlyTable(),
        "cost",
        ("NNX costs more than Linen on mesh", "forward: argument_bytes NNX"),
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
