"""Faults in how NNX constrains its activations, each with numbers equal to Linen's.

Each is a partitioning change only: the forward computes the same values on another
layout, so ``activation_sharding`` must name the module whose values move.
"""

from __future__ import annotations

import jax

from conformance_models import common
from conformance_models.gpt3 import nnx_model as gpt3_nnx
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from conformance_models.nnx_layers import constrain
from tests.faults.fault import Fault


def _attention_output_unconstrained(self, x, segment_ids, mode):
    """gpt3's NNX attention without the constraint on its output."""
    qkv = self.qkv(constrain(x, common.ACTIVATION_EMBED, self.config))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    k, v, mask = self.kv_cache(k, v, segment_ids, mode)
    return self.out(common.dot_product_attention(q, k, v, mask, self.dtype))


def _mlp_hidden_misspelt(self, x):
    """Llama's NNX MLP constraining its hidden activation as ``activation_mpl``: no rule
    has that name, so the dimension resolves to replicated."""
    hidden = jax.nn.silu(self.gate(x)) * self.up(x)
    misspelt = ("activation_batch", "activation_length", "activation_mpl")
    return self.down(constrain(hidden, misspelt, self.config))


def _logits_axes_swapped(self, *args, **kwargs):
    """gpt3's NNX decoder whose logits constraint names its axes in another order."""
    out = _gpt3_call(self, *args, **kwargs)
    if kwargs.get("targets") is not None:
        return out
    swapped = ("activation_length", "activation_batch", "activation_vocab")
    return constrain(out, swapped, self.config)


_gpt3_call = gpt3_nnx.Gpt3.__call__

FAULTS = (
    Fault(
        Gpt3Family(),
        "activation_sharding",
        (
            "layers_0/attn (NNX layers/0/attn): Linen alone constrains 8x32x64 to "
            "P(('data', 'fsdp'), None, None) = 4x1x1 shards",
            "the compiled layouts agree on this mesh",
            "forward: collectives: Linen",
            "likely cause: a partitioning change, not a numeric one",
        ),
        model_patch=(gpt3_nnx.Attention, "__call__", _attention_output_unconstrained),
        mesh_axes=("data", "fsdp", "tensor"),
    ),
    Fault(
        LlamaFamily(),
        "activation_sharding",
        (
            "layers_0/mlp/down (NNX layers/0/mlp/down) __call__ input 0 [8x32x128]: "
            "Linen P(('data', 'fsdp'), None, 'tensor') = 4x1x2 shards, "
            "NNX P(('data', 'fsdp'), None, None) = 4x1x1 shards",
        ),
        model_patch=(llama_nnx.Mlp, "__call__", _mlp_hidden_misspelt),
        mesh_axes=("data", "fsdp", "tensor"),
    ),
    Fault(
        LlamaFamily(),
        "activation_sharding_tpu",
        (
            "activation shardings differ (loop layout, TPU v6e:2x4",
            "layers_0/mlp/down (NNX layers/0/mlp/down) __call__ input 0 [8x32x128]: "
            "Linen P(('data', 'fsdp'), None, 'tensor') = 4x1x2 shards, "
            "NNX P(('data', 'fsdp'), None, None) = 4x1x1 shards",
        ),
        model_patch=(llama_nnx.Mlp, "__call__", _mlp_hidden_misspelt),
        mesh_axes=("tensor",),
    ),
    Fault(
        Gpt3Family(),
        "activation_sharding",
        (
            "(the top module) __call__ output 0 [8x32x256]: "
            "Linen P(('data', 'fsdp'), None, 'tensor') = 4x1x2 shards, NNX",
        ),
        model_patch=(gpt3_nnx.Gpt3, "__call__", _logits_axes_swapped),
        mesh_axes=("data", "fsdp", "tensor"),
    ),
)
"""Every activation fault, with the words its report must contain."""
