"""Benign variants: correct NNX models written differently from their Linen twins.

The mirror of the planted faults. Each variant changes how the built-in llama's NNX side
computes, never what: another order of sub-calls, another attention kernel, another
formula for the same normalisation, ``einsum`` for ``dot_general``. Every check listed
for a variant must pass on it; a harness that fails one cries wolf. The false alarms
the harness still raises are listed per variant as strict expected failures, so the
fix (a quantization-aware comparison) turns them red until they are removed.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from conformance.contract import Family, QuantScope
from conformance_models import common, nnx_layers
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily

CHECKS: tuple[tuple[str, str | None], ...] = (
    ("forward", None),
    ("train_step", None),
    ("decode", None),
    ("quant_forward", "ptq_int8"),
    ("quant_forward", "qat_int8"),
    ("qat_train_step", "qat_int8"),
)
"""``(check, quantization mode)`` every variant must pass: float, decode and Qwix."""


_ROUNDING = (
    "a false alarm the harness still raises: the float programs differ by rounding only "
    "(forward and train_step pass), quantization moves a rounding-level difference across "
    "quantization steps, and the check compares quantized results with the float32 tolerance"
)
_EINSUM_PTQ = (
    "open: the float forwards agree bitwise and so do the qat_int8 ones, but Qwix's PTQ "
    "quantizes an einsum's activations differently from a dot_general's (logits 2.1e-2 "
    "apart in relative L2, each side 3.4e-2 from its float run); the quantized parameters "
    "agree exactly"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A correct NNX variant: the NNX method it replaces and what it changes, in words."""

    name: str
    what: str
    patch: tuple[Any, str, Any]
    """``(class, method name, replacement)`` in the built-in NNX model's code."""
    family: Family = dataclasses.field(default_factory=LlamaFamily)
    false_alarms: Mapping[tuple[str, str | None], str] = dataclasses.field(default_factory=dict)
    """Checks of :data:`CHECKS` that still fail on this correct variant, with why (strict
    xfails)."""

    def false_alarm(self, check: str, quant: str | None) -> str | None:
        """Why ``check`` still fails on this variant, if it does."""
        return self.false_alarms.get((check, quant))


def _up_before_gate(self: llama_nnx.Mlp, x: jax.Array) -> jax.Array:
    up = self.up(x)
    return self.down(up * jax.nn.silu(self.gate(x)))


def _reciprocal_sqrt_by_division(self: llama_nnx.RMSNorm, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _jax_attention(
    self: llama_nnx.Attention,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    mode: str,
) -> jax.Array:
    q = common.apply_rope(self.q(x), positions, self.rope_base)
    k = common.apply_rope(self.k(x), positions, self.rope_base)
    k, v, mask = self.kv_cache(k, self.v(x), segment_ids, mode)
    out = jax.nn.dot_product_attention(
        q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype), mask=mask
    )
    return self.o(out.astype(self.dtype))


def _einsum_projection(self: nnx_layers.DenseGeneral, x: jax.Array) -> jax.Array:
    if self.aqt_mode is not None or self.fp8 or self.kernel is None:
        return _DENSE_CALL(self, x)
    x, kernel = nnx.nn.dtypes.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
    letters = iter(string.ascii_lowercase)
    lead = "".join(next(letters) for _ in range(x.ndim - self.num_in))
    contracted = "".join(next(letters) for _ in range(self.num_in))
    out = "".join(next(letters) for _ in range(kernel.ndim - self.num_in))
    y = jnp.einsum(f"{lead}{contracted},{contracted}{out}->{lead}{out}", x, kernel)
    if self.bias is not None:
        y = y + self.bias[...].astype(self.dtype)
    return y


_DENSE_CALL = nnx_layers.DenseGeneral.__call__


class EinsumScope(LlamaFamily):
    """The built-in llama whose Qwix scope covers ``einsum`` beside ``dot_general``."""

    def quantization_scope(self, config: Any) -> QuantScope:
        return dataclasses.replace(
            super().quantization_scope(config), op_names=("dot_general", "einsum")
        )


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "mlp-up-before-gate",
        "the MLP calls its up projection before its gate",
        (llama_nnx.Mlp, "__call__", _up_before_gate),
    ),
    Variant(
        "rmsnorm-division",
        "RMSNorm divides by sqrt(mean(x*x) + eps) instead of multiplying by rsqrt",
        (llama_nnx.RMSNorm, "__call__", _reciprocal_sqrt_by_division),
        false_alarms={("qat_train_step", "qat_int8"): _ROUNDING},
    ),
    Variant(
        "jax-attention",
        "attention is jax.nn.dot_product_attention (scale on the scores, XLA softmax)",
        (llama_nnx.Attention, "__call__", _jax_attention),
        false_alarms={
            ("quant_forward", "ptq_int8"): _ROUNDING,
            ("quant_forward", "qat_int8"): _ROUNDING,
            ("qat_train_step", "qat_int8"): _ROUNDING,
        },
    ),
    Variant(
        "einsum-projection",
        "every projection is jnp.einsum instead of lax.dot_general",
        (nnx_layers.DenseGeneral, "__call__", _einsum_projection),
        EinsumScope(),
        false_alarms={("quant_forward", "ptq_int8"): _EINSUM_PTQ},
    ),
)
"""Every benign variant."""
