"""Faults in quantization: Qwix rules and scales, AQT bits, frozen kernels, serving."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from aqt.jax.v2 import config as aqt_config
from flax import nnx
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.utils import flax_util as qwix_flax_util

from conformance.families import QuantScope
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from tests.benign.variants import jax_attention
from tests.faults.fault import Fault, Gpt3, Llama, NnxConfigFault


class RuleForLinenPathsOnly(Gpt3Family):
    """Quantization rules written for Linen's ``layers_<i>/`` paths: NNX is never quantized."""

    def quantization_scope(self, config):
        del config
        return QuantScope(module_path=r"layers_\d+/.*")


class QuantizesOnlyFirstNnxBlock(Gpt3Family):
    """The quantization rule matches every Linen block but only NNX block 0.

    No rule is a no-op on either side, so only the quantized forwards can tell.
    """

    def quantization_scope(self, config):
        del config
        return QuantScope(module_path=r"(layers_\d+|layers/0)/.*")


class RoundsAndQuantizesOnlyFirstNnxBlock(LlamaFamily):
    """NNX's attention rounds differently (benign alone) and only NNX block 0 is quantized.

    With the benign rounding difference the float forwards are no longer bitwise equal,
    so the quantization-aware policy judges the quantized ones in its rounding regime:
    this fault must still fail there.
    """

    def quantization_scope(self, config):
        return dataclasses.replace(
            super().quantization_scope(config), module_path=r"(layers_\d+|layers/0)/.*"
        )


def _rounding_jax_attention(self, *args):
    """NNX attention through ``jax.nn.dot_product_attention`` (a benign variant's), an ulp off.

    Whether that attention rounds differently from the built-in one depends on the CPU
    XLA compiles for (on a 2-core AMD EPYC with AVX2 the float forwards agreed bitwise);
    scaling its output by ``1 + eps`` makes them differ by rounding on every machine.
    """
    out = jax_attention(self, *args)
    return out * (1 + jnp.finfo(out.dtype).eps)


_how_to_quantize = qwix_dot_general.get_how_to_quantize


def _nnx_scale_on_input_axes(**kwargs):
    """Qwix's how-to-quantize with NNX kernels scaled per input channel, not per output.

    Planted in the library (qwix decides the scale axes), for NNX modules only.
    """
    how = _how_to_quantize(**kwargs)
    if kwargs["for_lhs"] or not isinstance(qwix_flax_util.get_current_module(), nnx.Module):
        return how
    contracting = kwargs["dimension_numbers"][0][1]
    return dataclasses.replace(how, channelwise_axes=sorted(contracting))


def keeps_transients(model):
    """``strip_transients`` that leaves Qwix's tracing-forward intermediates in place."""
    del model


def _requantize(dense: nnx.Module, **fully_quantized: Any) -> None:
    """Give an NNX ``DenseGeneral``'s bridged AQT layer another ``fully_quantized`` config."""
    options = {"fwd_bits": 8, "bwd_bits": 8, "use_stochastic_rounding": False} | fully_quantized
    bridged = dense.AqtDotGeneral_0
    bridged.to_nnx__module = bridged.to_nnx__module.clone(cfg=aqt_config.fully_quantized(**options))


class AqtDropped(NnxConfigFault, Gpt3Family):
    """The AQT mode never reaches NNX: its projections stay float."""

    changes: ClassVar[dict[str, Any]] = {"aqt_mode": None}


class AqtSevenBits(Gpt3Family):
    """NNX block 0's MLP input projection is quantized to 7 bits, not 8, by AQT."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.aqt_mode is not None:
            _requantize(model.layers[0].mlp.wi, fwd_bits=7)
        return model


class AqtFloatBackward(LlamaFamily):
    """NNX block 1's MLP down projection quantizes its forward but not its gradients."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.aqt_mode is not None:
            _requantize(model.layers[1].mlp.down, bwd_bits=None)
        return model


class AqtServeKeepsFloatKernel(Gpt3Family):
    """NNX's serve-mode model still holds block 0's float MLP input kernel."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.aqt_mode == "serve":
            float_model = super().nnx_module(dataclasses.replace(config, aqt_mode=None), rngs)
            model.layers[0].mlp.wi.kernel = float_model.layers[0].mlp.wi.kernel
        return model


def zero_fills_qvalue(restored):
    """A restore that gives back every ``qvalue`` as zeros (the dtype and shape are right)."""
    return {p: jnp.zeros_like(v) if p.endswith("/qvalue") else v for p, v in restored.items()}


FAULTS = (
    Fault(
        RuleForLinenPathsOnly(),
        "quant_forward",
        ("NNX qat_int8: a rule is a no-op", r"module_path='layers_\\d+/.*'"),
        quant="qat_int8",
    ),
    Fault(
        QuantizesOnlyFirstNnxBlock(),
        "quant_forward",
        (
            "qat_int8 forward on mesh",
            "logits:",
            "verdict: a Linen/NNX divergence: it shows on one device too",
        ),
        quant="qat_int8",
    ),
    Fault(
        QuantizesOnlyFirstNnxBlock(),
        "qat_train_step",
        ("step 1 of 3 (qat_int8)", "the float train steps agree bitwise"),
        quant="qat_int8",
    ),
    Fault(
        RoundsAndQuantizesOnlyFirstNnxBlock(),
        "quant_forward",
        (
            "qat_int8 forward on mesh",
            "the float forwards differ by rounding only",
            "the sides are not equally far from float",
        ),
        model_patch=(llama_nnx.Attention, "__call__", _rounding_jax_attention),
        quant="qat_int8",
    ),
    Fault(
        Gpt3(),
        "quant_params",
        (
            "layers/0/attn/qkv/kernel/array/scale: Linen float32[1, 3, 4, 16]",
            "!= NNX float32[64, 1, 1, 1]",
        ),
        model_patch=(qwix_dot_general, "get_how_to_quantize", _nnx_scale_on_input_axes),
        quant="ptq_int8",
    ),
    Fault(
        Gpt3(),
        "quant_hygiene",
        (
            "hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate) "
            "appeared with quantization",
        ),
        seams={"qwix_strip_transients": keeps_transients},
        quant="qat_int8",
    ),
    Fault(
        Gpt3(),
        "quant_hygiene_topology",
        (
            "hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate) "
            "appeared with quantization",
        ),
        seams={"qwix_strip_transients": keeps_transients},
        size="6b",
    ),
    Fault(
        Llama(),
        "quant_checkpoint",
        (
            "Linen ptq_int8 parameters after an orbax round trip",
            "layers_0/attn/k/kernel/array/qvalue",
        ),
        seams={"checkpoint_restored": zero_fills_qvalue},
        quant="ptq_int8",
    ),
    Fault(
        AqtDropped(),
        "aqt_forward",
        (
            "AQT int8 TRAIN forward on mesh",
            "logits",
            "verdict: a Linen/NNX divergence: it shows on one device too",
        ),
    ),
    Fault(
        AqtFloatBackward(),
        "aqt_train_step",
        ("step 1 of", "layers/1/mlp/down/kernel"),
    ),
    Fault(
        AqtServeKeepsFloatKernel(),
        "aqt_layout",
        ("NNX layers/0/mlp/wi/kernel: frozen, yet the float kernel is still a serve parameter",),
    ),
    Fault(
        AqtSevenBits(),
        "aqt_convert",
        (
            "frozen kernels (qvalue, scale) after CONVERT on mesh",
            "layers/0/mlp/wi/AqtDotGeneral_0/qrhs/frozen/qvalue",
        ),
    ),
    Fault(
        Gpt3(),
        "aqt_serve",
        (
            "Linen AQT serve tree after an orbax round trip",
            "aqt/layers_0/attn/out/AqtDotGeneral_0/qrhs/frozen/qvalue",
        ),
        seams={"checkpoint_restored": zero_fills_qvalue},
    ),
)
