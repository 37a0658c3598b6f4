"""Benign variants: correct NNX models written differently from their Linen twins.

The mirror of the planted faults. Each variant changes how a built-in family's NNX side
computes, never what: another order of sub-calls, another attention kernel, another
formula for the same normalisation, one fused projection for three, ``einsum`` for
``dot_general``, an activation constraint through another API or moved to the enclosing
module; or rewrites both sides alike in a way a zoo may (padded vocabulary
entries masked to ``-inf``). Every check listed for a variant must pass on it; a harness that fails
one cries wolf. Float rounding that quantization carries across quantization steps
passes through the quantization-aware policy (:mod:`conformance.core.rounding`). A check
that rightly sees a real difference in a variant is listed with why, as a strict
expected failure.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from conformance.contract import (
    Family,
    Pair,
    Precision,
    PrecisionChange,
    QuantScope,
    with_features,
)
from conformance_models import common, nnx_layers
from conformance_models.llama import linen_model as llama_linen
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from conformance_models.moe import nnx_model as moe_nnx
from conformance_models.moe import routing
from conformance_models.moe.family import MoeFamily
from conformance_models.nnx_layers import constrain
from tests.faults.modes import EmbedByOneHotWhenExplicit, TiedByAttendInTreeMode

CHECKS: tuple[tuple[str, str | None], ...] = (
    ("activation_sharding", None),
    ("precision", None),
    ("forward", None),
    ("train_step", None),
    ("bf16_train_step", None),
    ("decode", None),
    ("decode_consistency", None),
    ("quant_forward", "ptq_int8"),
    ("quant_forward", "qat_int8"),
    ("qat_train_step", "qat_int8"),
)
"""``(check, quantization mode)`` a llama variant must pass: activation shardings,
precision, float (bfloat16 training too), decode (bfloat16 self-consistency too) and
Qwix."""

IN_BFLOAT16 = frozenset({"decode", "decode_consistency", "grad_accumulation"})
"""Checks a variant runs in bfloat16 compute, not float32: the suite runs them in both on
the unchanged models, and the variants' float32 numbers are covered by ``forward`` and
``train_step``."""

IN_BOTH = frozenset({"forward"})
"""Checks a variant runs in float32 and in bfloat16 compute."""


def dtypes_of(check: str) -> tuple[Any, ...]:
    """The compute dtypes a variant runs ``check`` in."""
    if check in IN_BOTH:
        return (jnp.float32, jnp.bfloat16)
    return (jnp.bfloat16,) if check in IN_BFLOAT16 else (jnp.float32,)


_FUSED_PTQ = (
    "rightly seen: Qwix's PTQ stores a kernel as qvalue and scale only where a dot_general "
    "takes the parameter itself, so the fused projection's NNX model keeps its query, key "
    "and value kernels in float and quantizes their concatenation at run time (qat_int8 "
    "passes); the report says so"
)
_EINSUM_PTQ = (
    "rightly seen: the float forwards agree bitwise, so the quantization-aware policy holds "
    "the quantized forwards to the float tolerance, and Qwix's PTQ computes an einsum of "
    "quantized operands differently from a dot_general (the quantized parameters agree "
    "exactly; logits 2.1e-2 apart in relative L2, each side 3.4e-2 from its float run); "
    "the report says the float forwards agree bitwise and the sides quantize differently"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A correct variant: the methods it replaces and what it changes, in words."""

    name: str
    what: str
    patches: tuple[tuple[Any, str, Any], ...]
    """``(class, method name, replacement)`` in the built-in models' code: NNX's, or both
    sides' alike."""
    family: Family = dataclasses.field(default_factory=LlamaFamily)
    expected_failures: Mapping[tuple[str, str | None], str] = dataclasses.field(
        default_factory=dict
    )
    """Checks of :data:`CHECKS` that fail on this variant, each with why in words (strict
    xfails)."""
    checks: tuple[tuple[str, str | None], ...] = CHECKS
    """``(check, quantization mode)`` it must pass (a family's own capabilities differ)."""
    pair: Pair = Pair.LINEN_NNX
    """The sides its checks with a ``pair`` axis compare (a mode's rewrite: that mode)."""

    def expected_failure(self, check: str, quant: str | None) -> str | None:
        """Why ``check`` fails on this variant, if it does."""
        return self.expected_failures.get((check, quant))


def _up_before_gate(self: llama_nnx.Mlp, x: jax.Array) -> jax.Array:
    up = self.up(x)
    return self.down(constrain(up * jax.nn.silu(self.gate(x)), common.ACTIVATION_MLP, self.config))


def _reciprocal_sqrt_by_division(self: llama_nnx.RMSNorm, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def attention_with(kernel: Any, *, output_constrained: bool = True) -> Any:
    """Llama's NNX attention ``__call__``, ``kernel(q, k, v, mask, dtype)`` its attention.

    The replacement is named after ``kernel``. Without ``output_constrained`` it leaves
    its output for the caller to constrain.
    """

    def call(
        self: llama_nnx.Attention,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        mode: str,
    ) -> jax.Array:
        x = constrain(x, common.ACTIVATION_EMBED, self.config)
        q = common.apply_rope(self.q(x), positions, self.rope_base)
        k = common.apply_rope(self.k(x), positions, self.rope_base)
        k, v, mask = self.kv_cache(k, self.v(x), segment_ids, mode)
        out = self.o(kernel(q, k, v, mask, self.dtype))
        return constrain(out, common.ACTIVATION_EMBED, self.config) if output_constrained else out

    call.__name__ = kernel.__name__
    return call


def _jax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: Any) -> Any:
    """``jax.nn.dot_product_attention`` in ``dtype``."""
    out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask=mask)
    return out.astype(dtype)


jax_attention = attention_with(_jax_attention)
"""Llama's NNX attention through ``jax.nn.dot_product_attention``."""


class JaxAttentionLlama(LlamaFamily):
    """Llama, accepting the float32 score accumulation of ``jax.nn.dot_product_attention``."""

    def features(self):
        accepted = PrecisionChange(
            r"layers(_\d+|/\d+)?/attn",
            ("dot_general",),
            "jax.nn.dot_product_attention accumulates the attention scores in float32",
        )
        return with_features(super().features(), Precision((accepted,)))


def _fused_qkv(
    self: llama_nnx.Attention,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    mode: str,
) -> jax.Array:
    projections = (self.q, self.k, self.v)
    if any(p.aqt_mode is not None or p.fp8 or p.kernel is None for p in projections):
        return _ATTENTION_CALL(self, x, positions, segment_ids, mode)
    x = constrain(x, common.ACTIVATION_EMBED, self.config)
    kernel = jnp.concatenate([p.kernel[...] for p in projections], axis=1)
    x, kernel = nnx.nn.dtypes.promote_dtype((x, kernel), dtype=self.dtype)
    qkv = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    heads, kv_heads = self.q.kernel_shape[1], self.k.kernel_shape[1]
    q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
    q = common.apply_rope(q, positions, self.rope_base)
    k = common.apply_rope(k, positions, self.rope_base)
    k, v, mask = self.kv_cache(k, v, segment_ids, mode)
    out = self.o(common.dot_product_attention(q, k, v, mask, self.dtype))
    return constrain(out, common.ACTIVATION_EMBED, self.config)


_ATTENTION_CALL = llama_nnx.Attention.__call__


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


def _experts_one_by_one(self: moe_nnx.MoeMlp, x: jax.Array) -> jax.Array:
    cfg = self.config
    probs = routing.router_probabilities(self.router(x))
    mean_prob = probs.mean(axis=(0, 1))
    self.sow(
        nnx.Intermediate, routing.AUX_LOSS, cfg.lb_weight * cfg.num_experts * mean_prob @ mean_prob
    )
    x = x.astype(cfg.dtype)
    out = jnp.zeros_like(x)
    for e in range(cfg.num_experts):
        gate, up, down = (w[e].astype(cfg.dtype) for w in (self.wi_gate, self.wi_up, self.wo))
        hidden = jax.nn.silu(x @ gate) * (x @ up)
        out = out + (hidden @ down) * probs[..., e : e + 1].astype(cfg.dtype)
    return out


def _hidden_through_linen_api(self: llama_nnx.Mlp, x: jax.Array) -> jax.Array:
    """Llama's NNX MLP constraining its hidden through Linen's logical-constraint function."""
    cfg = self.config
    hidden = jax.nn.silu(self.gate(x)) * self.up(x)
    hidden = nn.with_logical_constraint(
        hidden, common.ACTIVATION_MLP, rules=cfg.rules, mesh=cfg.mesh
    )
    return self.down(hidden)


def _block_constraining_attention(
    self: llama_nnx.Block, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, **kw: Any
) -> jax.Array:
    """Llama's NNX block constraining attention's output, as attention no longer does."""
    h = self.attn(self.attn_norm(x), positions, segment_ids, kw["mode"])
    h = constrain(h, common.ACTIVATION_EMBED, self.attn.config)
    if self.dropout is not None:
        h = self.dropout(h, deterministic=kw["deterministic"])
    x = x + h
    h = self.mlp(self.mlp_norm(x))
    if self.dropout is not None:
        h = self.dropout(h, deterministic=kw["deterministic"])
    return x + h


PADDED_VOCAB = 3
"""How many of the vocabulary's last entries :func:`_masking_padded_vocab` masks."""


def _masking_padded_vocab(call: Any) -> Any:
    """``call``, its logits' last :data:`PADDED_VOCAB` entries set to ``-inf``.

    A zoo that pads its vocabulary to a multiple of the shard count masks the padding so
    softmax gives it no mass: correct on both sides, and every logits row stays finite.
    """

    def masked(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = call(self, *args, **kwargs)
        vocab = out.shape[-1]
        padding = jnp.arange(vocab) >= vocab - PADDED_VOCAB
        return jnp.where(padding, jnp.asarray(-jnp.inf, out.dtype), out)

    return masked


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "mlp-up-before-gate",
        "the MLP calls its up projection before its gate",
        ((llama_nnx.Mlp, "__call__", _up_before_gate),),
    ),
    Variant(
        "rmsnorm-division",
        "RMSNorm divides by sqrt(mean(x*x) + eps) instead of multiplying by rsqrt",
        ((llama_nnx.RMSNorm, "__call__", _reciprocal_sqrt_by_division),),
    ),
    Variant(
        "jax-attention",
        "attention is jax.nn.dot_product_attention (scale on the scores, XLA softmax); "
        "it accumulates the scores in float32, a precision change the family accepts",
        ((llama_nnx.Attention, "__call__", jax_attention),),
        JaxAttentionLlama(),
    ),
    Variant(
        "fused-qkv",
        "one projection with the query, key and value kernels concatenated, then split",
        ((llama_nnx.Attention, "__call__", _fused_qkv),),
        expected_failures={("quant_forward", "ptq_int8"): _FUSED_PTQ},
        checks=(*CHECKS, ("grad_accumulation", None)),
    ),
    Variant(
        "einsum-projection",
        "every projection is jnp.einsum instead of lax.dot_general",
        ((nnx_layers.DenseGeneral, "__call__", _einsum_projection),),
        EinsumScope(),
        expected_failures={("quant_forward", "ptq_int8"): _EINSUM_PTQ},
    ),
    Variant(
        "moe-experts-one-by-one",
        "the MoE layer runs its experts in a Python loop and sums them, and takes the "
        "load-balancing loss's mean and square as a mean over axes and a dot product",
        ((moe_nnx.MoeMlp, "__call__", _experts_one_by_one),),
        MoeFamily(),
        checks=(
            ("precision", None),
            ("forward", None),
            ("train_step", None),
            ("aux_losses", None),
        ),
    ),
    Variant(
        "constraint-through-linen-api",
        "the MLP constrains its hidden activation with flax.linen's with_logical_constraint "
        "rather than jax.lax.with_sharding_constraint: the same spec",
        ((llama_nnx.Mlp, "__call__", _hidden_through_linen_api),),
        checks=(("activation_sharding", None), ("forward", None), ("train_step", None)),
    ),
    Variant(
        "constraint-moved-to-block",
        "attention's output is constrained by the block that calls it, not inside attention",
        (
            (
                llama_nnx.Attention,
                "__call__",
                attention_with(common.dot_product_attention, output_constrained=False),
            ),
            (llama_nnx.Block, "__call__", _block_constraining_attention),
        ),
        checks=(("activation_sharding", None), ("forward", None), ("cost", None)),
    ),
    Variant(
        "padded-vocab-masked",
        f"both sides set the logits of the vocabulary's last {PADDED_VOCAB} entries to -inf",
        (
            (llama_linen.Llama, "__call__", _masking_padded_vocab(llama_linen.Llama.__call__)),
            (llama_nnx.Llama, "__call__", _masking_padded_vocab(llama_nnx.Llama.__call__)),
        ),
        checks=(("finite", None), ("precision", None), ("forward", None)),
    ),
    Variant(
        "tie-as-attend-in-tree-mode",
        "gpt3's NNX model ties its head to its embedding by a shared reference in graph "
        "mode; its tree-mode rewrite ties them by calling the embedding's attend",
        (),
        TiedByAttendInTreeMode(),
        checks=(
            ("tree_mode", None),
            ("structure", None),
            ("sharding", None),
            ("init", None),
            ("forward", None),
            ("train_step", None),
            ("cost", None),
            ("activation_sharding", None),
        ),
        pair=Pair.GRAPH_TREE,
    ),
    Variant(
        "embed-by-one-hot-on-explicit-axes",
        "gpt3's NNX model looks its embeddings up by index on auto axes; its rewrite for "
        "explicit axes contracts a one-hot encoding with the table instead",
        (),
        EmbedByOneHotWhenExplicit(),
        checks=(
            ("explicit_sharding", None),
            ("activation_sharding", None),
            ("sharding", None),
            ("init", None),
            ("forward", None),
            ("train_step", None),
        ),
        pair=Pair.AUTO_EXPLICIT,
    ),
)
"""Every benign variant."""
