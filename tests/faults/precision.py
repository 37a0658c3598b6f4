"""Faults in which dtypes a forward computes in, each named at its module by ``precision``.

Each changes precision only: the numbers move by rounding, if at all, so a tolerance
cannot name them. The benign ``jax-attention`` variant's attention under a family that
does not accept its float32 scores is one; a family's accepted change that covers nothing
is another.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from conformance.contract import Precision, PrecisionChange, with_features
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from tests.benign.variants import attention_with, jax_attention
from tests.faults.fault import Fault
from tests.faults.forward import Bfloat16OnlyEpsilon, NormEpsilon, SilentBfloat16


def _softmax_in_compute_dtype(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: Any
) -> jax.Array:
    """Llama's attention with its softmax in the compute dtype (Linen's: float32)."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    q = q.astype(dtype) * jnp.asarray(q.shape[-1] ** -0.5, dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k.astype(dtype))
    weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(dtype).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(dtype))


def _silu_in_float32(self: llama_nnx.Mlp, x: jax.Array) -> jax.Array:
    """Llama's NNX MLP with its gate's SiLU in float32 (Linen's: the compute dtype)."""
    gate = jax.nn.silu(self.gate(x).astype(jnp.float32)).astype(x.dtype)
    return self.down(gate * self.up(x))


def _norm_returns_float32(self: llama_nnx.RMSNorm, x: jax.Array) -> jax.Array:
    """Llama's NNX RMSNorm without its cast back to the compute dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return y * self.scale[...].astype(jnp.float32)


class StaleAcceptance(LlamaFamily):
    """Llama accepting a float32 softmax in its attention that neither side computes apart."""

    def features(self):
        stale = PrecisionChange(r"layers_\d+/attn", ("exp",), "NNX's softmax runs in float32")
        return with_features(super().features(), Precision((stale,)))


FAULTS = (
    Fault(
        SilentBfloat16(),
        "precision",
        (
            "float32 compute: layers_1/mlp/down (NNX layers/1/mlp/down): NNX rounds "
            "float32 -> bfloat16, Linen does not round there; NNX computes dot_general in "
            "bfloat16 -> bfloat16, Linen dot_general in float32 -> float32; NNX's __call__ "
            "returns bfloat16, Linen's float32",
            "likely cause: a precision change",
        ),
    ),
    Fault(
        LlamaFamily(),
        "precision",
        (
            "bfloat16 compute: layers_0/attn (NNX layers/0/attn): NNX computes exp in "
            "bfloat16, Linen exp in float32",
            "NNX computes reduce_max in bfloat16, Linen reduce_max in float32",
        ),
        model_patch=(llama_nnx.Attention, "__call__", attention_with(_softmax_in_compute_dtype)),
    ),
    Fault(
        LlamaFamily(),
        "precision",
        (
            "bfloat16 compute: layers_0/mlp (NNX layers/0/mlp): NNX computes logistic in "
            "float32, Linen logistic in bfloat16",
        ),
        model_patch=(llama_nnx.Mlp, "__call__", _silu_in_float32),
    ),
    Fault(
        LlamaFamily(),
        "precision",
        (
            "bfloat16 compute: layers_0/attn_norm (NNX layers/0/attn_norm): Linen rounds "
            "float32 -> bfloat16, NNX does not round there; NNX's __call__ returns float32, "
            "Linen's bfloat16",
        ),
        model_patch=(llama_nnx.RMSNorm, "__call__", _norm_returns_float32),
    ),
    Fault(
        LlamaFamily(),
        "precision",
        (
            "bfloat16 compute: layers_0/attn (NNX layers/0/attn): NNX computes dot_general "
            "in bfloat16 -> float32; Linen computes no sum of products in those dtypes",
        ),
        model_patch=(llama_nnx.Attention, "__call__", jax_attention),
    ),
    Fault(
        StaleAcceptance(),
        "precision",
        (
            "Precision is stale (loop layout)",
            "accepted change of layers_\\d+/attn (exp: NNX's softmax runs in float32) matches "
            "no difference in float32 or bfloat16 compute: stale",
        ),
    ),
    Fault(
        NormEpsilon(),
        "bf16_train_step",
        ("step 1 of 3 (bfloat16 compute)", "the float32 steps disagree too"),
    ),
    Fault(
        Bfloat16OnlyEpsilon(),
        "bf16_train_step",
        ("step 1 of 3 (bfloat16 compute)", "differ more than rounding moves them"),
    ),
)
