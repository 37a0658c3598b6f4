"""Qwix quantization modes, and how a module of either backend is quantized with them.

A mode is a method (``qat``: fake-quantized forward over float parameters; ``ptq``:
parameters stored as ``qvalue`` plus ``scale``) and a type for weights and activations.
Rules target what the family's :class:`~conformance.contract.QuantScope` names. The
harness never trusts a rule to have matched: every provider is kept so that a rule which
matched no operation (a silent no-op) can be reported.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import jax.numpy as jnp
import qwix
from flax import linen as nn
from flax import nnx

from conformance.contract import QuantScope
from conformance.core.failure import KnownFailure
from conformance.core.seams import seam
from conformance.runtime.sowing import outside_capture


@dataclasses.dataclass(frozen=True)
class QuantMode:
    """One Qwix quantization mode, with the error it may add to float logits."""

    name: str
    method: Literal["qat", "ptq"]
    qtype: str
    """Weight and activation type, a ``jax.numpy`` dtype name."""
    max_error: float
    """Bound on the relative L2 error of quantized logits against float logits."""

    def provider(self, scope: QuantScope) -> qwix.QuantizationProvider:
        """A fresh provider with one rule: weights and activations of ``scope`` in ``qtype``."""
        qtype = jnp.dtype(self.qtype)
        fields = {
            "module_path": scope.module_path,
            "op_names": scope.op_names,
            "weight_qtype": qtype,
            "act_qtype": qtype,
        }
        if self.method == "qat":
            return qwix.QtProvider([qwix.QtRule(**fields)])
        return qwix.PtqProvider([qwix.QuantizationRule(**fields)])


MODES: dict[str, QuantMode] = {
    mode.name: mode
    for mode in (
        QuantMode("qat_int8", "qat", "int8", max_error=0.06),
        QuantMode("qat_fp8", "qat", "float8_e4m3fn", max_error=0.25),
        QuantMode("ptq_int8", "ptq", "int8", max_error=0.06),
        QuantMode("ptq_fp8", "ptq", "float8_e4m3fn", max_error=0.25),
    )
}
"""Every mode the suite knows, by name."""


_WRONG_SCALES = r"CheckFailure: .* {quant} quantized parameters on mesh \S+: .*/kernel/array/scale"
"""The words of Linen's stacked kernel scales disagreeing with NNX's, for a mode ``quant``."""


def known_failure(quant: str, scan_layers: bool) -> KnownFailure | None:
    """Why ``quant`` cannot pass on this layer layout with the pinned libraries, if so."""
    if MODES[quant].method == "ptq" and scan_layers:
        return KnownFailure(
            "qwix 0.1.8: quantize_params on nn.scan-stacked Linen parameters computes scales "
            "over the wrong axes (the per-layer how-to-quantize is applied to the stacked "
            "array: attn/out kernel [2, 4, 16, 64] gets scale [1, 1, 16, 1], not [2, 1, 1, 64]"
            " as NNX's quantize_model gives)",
            _WRONG_SCALES.format(quant=re.escape(quant)),
        )
    return None


def unused_rules(provider: qwix.QuantizationProvider) -> list[str]:
    """The provider's rules that matched no operation, as readable lines."""
    return [
        f"rule module_path={rule.module_path!r} op_names={tuple(rule.op_names)} "
        "matched no operation: quantization did nothing there"
        for rule in provider.get_unused_rules()
    ]


def quantize_linen(module: nn.Module, provider: qwix.QuantizationProvider) -> nn.Module:
    """``module`` with its ``__call__`` quantized by ``provider`` (applied lazily by Qwix)."""
    return qwix.quantize_model(module, provider)


def quantize_nnx(
    model: nnx.Module, provider: qwix.QuantizationProvider, inputs: tuple[Any, ...]
) -> nnx.Module:
    """``model`` quantized by ``provider``, with nothing transient left in its state.

    Qwix traces a forward on ``inputs`` to find the operations to quantize; whatever
    that forward sowed (``nnx.Intermediate`` and the like) is removed, so the quantized
    model holds the same kinds of state as the float one.
    """
    with outside_capture():
        quantized = qwix.quantize_model(model, provider, *inputs)
    seam("qwix_strip_transients", strip_transients)(quantized)
    return quantized


def strip_transients(model: nnx.Module) -> None:
    """Remove every ``nnx.Intermediate`` (sowed value) from ``model`` in place."""
    nnx.pop(model, nnx.Intermediate)
