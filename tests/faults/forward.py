"""Faults in what the forward computes, each named at its first divergent module."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from tests.contract.toyzoo.families import ToyMinimal
from tests.contract.toyzoo.stacked import ToyStacked
from tests.faults.fault import Fault, NnxConfigFault


class NormEpsilon(NnxConfigFault, LlamaFamily):
    """NNX RMSNorm epsilon is 1e-5 instead of 1e-6."""

    changes: ClassVar[dict[str, Any]] = {"norm_eps": 1e-5}


class RopeBase(NnxConfigFault, LlamaFamily):
    """NNX RoPE base is 20000 instead of 10000."""

    changes: ClassVar[dict[str, Any]] = {"rope_base": 20_000.0}


class SilentBfloat16(LlamaFamily):
    """NNX block 1's MLP output projection computes in bfloat16 under a float32 config."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[1].mlp.down.dtype = jnp.bfloat16
        return model


_block_call = llama_nnx.Block.__call__


def _residual_in_bfloat16(self: llama_nnx.Block, x: jax.Array, *args, **kwargs) -> jax.Array:
    """Llama's NNX block handing its residual stream on in bfloat16 (Linen's: float32)."""
    return _block_call(self, x, *args, **kwargs).astype(jnp.bfloat16)


class Bfloat16OnlyEpsilon(LlamaFamily):
    """Under bfloat16 compute only, NNX block 1's MLP RMSNorm epsilon is 1.0.

    A config path one dtype takes: the float32 steps agree, the bfloat16 ones do not.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.dtype == jnp.bfloat16:
            model.layers[1].mlp_norm.eps = 1.0
        return model


class ToyNormEpsilon(ToyMinimal):
    """A third-party family that sows nothing: NNX block 1's LayerNorm epsilon is 1e-2."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.blocks[1].norm.epsilon = 1e-2
        return model


class SwappedSplit(ToyStacked):
    """The family's Split sends the stacked leaf's first slice to ``up``, the second to ``gate``.

    Both kernels have one shape, so the structure agrees; the numbers cannot.
    """

    def path_rules(self, config):
        split, *rest = super().path_rules(config)
        return (dataclasses.replace(split, into=split.into[::-1]), *rest)


class NanOnOneSide(NnxConfigFault, LlamaFamily):
    """NNX RMSNorm epsilon is negative: rsqrt of a negative number gives NaN on NNX only."""

    changes: ClassVar[dict[str, Any]] = {"norm_eps": -1.0}


class NanOnBothSides(LlamaFamily):
    """The config both sides read has a negative RMSNorm epsilon: NaN logits on both."""

    def config(self, *args, **kwargs):
        return dataclasses.replace(super().config(*args, **kwargs), norm_eps=-1.0)


class RaisesOnNnx(LlamaFamily):
    """NNX block 1's MLP output projection contracts two input axes: its forward raises."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[1].mlp.down.num_in = 2
        return model


FAULTS = (
    Fault(
        NormEpsilon(),
        "forward",
        (
            "logits:",
            "first divergent module: layers_0/attn_norm (NNX layers/0/attn_norm)",
            "verdict: a Linen/NNX divergence: it shows on one device too",
        ),
    ),
    Fault(
        RopeBase(),
        "forward",
        ("logits:", "first divergent module: layers_0/attn (NNX layers/0/attn), __call__"),
    ),
    Fault(
        SilentBfloat16(),
        "forward",
        (
            "logits:",
            "first divergent module: layers_1/mlp/down (NNX layers/1/mlp/down)",
            "precision differs: layers_1/mlp/down (NNX layers/1/mlp/down): NNX rounds "
            "float32 -> bfloat16",
        ),
    ),
    Fault(
        LlamaFamily(),
        "forward",
        (
            "logits:",
            "first divergent module: layers_0 (NNX layers/0), __call__: its inputs agree and "
            "its output does not",
            "precision differs: layers_0 (NNX layers/0): NNX rounds float32 -> bfloat16",
        ),
        model_patch=(llama_nnx.Block, "__call__", _residual_in_bfloat16),
    ),
    Fault(
        RopeBase(),
        "forward",
        (
            "logits:",
            "first divergent module: layers_0/attn (NNX layers/0/attn), __call__",
            "bfloat16 rounding: the float32 forwards disagree too",
            "a divergence the lower precision carries, not rounding",
        ),
        dtype=jnp.bfloat16,
    ),
    Fault(
        Bfloat16OnlyEpsilon(),
        "forward",
        (
            "logits:",
            "first divergent module: layers_1/mlp_norm (NNX layers/1/mlp_norm)",
            "bfloat16 rounding:",
            "farther than rounding moves it",
        ),
        dtype=jnp.bfloat16,
    ),
    Fault(
        ToyNormEpsilon(),
        "forward",
        (
            "logits:",
            "first divergent module: block_1/norm (NNX blocks/1/norm), __call__: "
            "its inputs agree and its output does not",
        ),
        size="small",
    ),
    Fault(
        SwappedSplit(),
        "forward",
        ("logits:", "first divergent module: block_0 (NNX blocks/0), __call__"),
        size="small",
    ),
    Fault(NanOnOneSide(), "forward", ("logits:", "non-finite on one side only")),
    Fault(
        NanOnOneSide(),
        "finite",
        ("NNX logits: ", "non-finite, first at index (0, 0, 0): nan", "of that side alone"),
    ),
    Fault(
        NanOnBothSides(),
        "finite",
        (
            "llama finite: non-finite logits on mesh",
            "Linen logits: ",
            "NNX logits: ",
            "likely cause: something every side shares",
        ),
    ),
    Fault(
        RaisesOnNnx(),
        "forward",
        (
            "NNX raised TypeError while running the forward (NnxRunner.forward)",
            "dot_general requires contracting dimensions to have the same shape",
            "raised at models/nnx_layers.py:",
            "the parameters it names: layers/0/mlp/down/kernel: shape (128, 64)",
            "only NNX fails: Linen gets through running the forward. A Linen/NNX divergence",
        ),
    ),
)
