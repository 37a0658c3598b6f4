"""MaxText families registered through the ``conformance.families`` entry point group.

Each family is one MaxText model shrunk by MaxText's own ``base_*`` overrides, built
twice by MaxText itself: its pure Linen ``TransformerLinenPure`` (``pure_nnx``,
``enable_nnx``, ``pure_nnx_decoder`` all False) and its NNX ``Transformer`` (all True).
Nothing here imports ``maxtext`` until a test needs a model, so the families load
without it and :meth:`MaxTextFamily.unavailable` gives the skip reason.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from conformance.families import (
    QUANTIZATION_MODES,
    Batch,
    Capabilities,
    Family,
    FamilyError,
    LogicalRules,
    PathRules,
    QuantScope,
)
from conformance_models.data import make_batch
from conformance_models.maxtext.config import SEQ_LEN, MaxTextConfig, hyperparameters

MAXTEXT_VERSION = "0.2.4"
"""The release the adapter targets: the last one with both a Linen and an NNX path."""

INSTALL_HINT = "pip install -e '.[maxtext]'"


class MaxTextFamily(Family):
    """A MaxText model, ``model_name`` shrunk by ``overrides``, as a conformance family."""

    sizes: tuple[str, ...] = ("tiny",)
    """``tiny`` (``model_name`` shrunk, run on devices), then production sizes: MaxText
    model ymls as shipped, evaluated abstractly (structure and sharding goldens)."""
    batch_axis = "activation_batch"
    layer_stack_axis = 1
    model_name: ClassVar[str]
    """The MaxText model (a yml under ``maxtext/configs/models``)."""
    overrides: ClassVar[Mapping[str, Any]]
    """MaxText config keys set on top of the model's yml (``override_model_config`` is on)."""
    production: ClassVar[Mapping[str, Mapping[str, Any]]] = MappingProxyType({})
    """Keys a production size's workload sets on top of its yml (none by default)."""

    capabilities = Capabilities(
        scan_layers=(True, False),  # MaxText's default is scanned layers: smoke runs those
        remat=True,
        dropout=True,
        decode=True,
        aqt=True,
        quantization=frozenset(QUANTIZATION_MODES),
        vocab_tiling=True,
        fp8=True,
    )
    train_rngs = ("dropout",)

    def unavailable(self) -> str | None:
        """Why MaxText families cannot run here: maxtext missing, or another version."""
        try:
            version = importlib.metadata.version("maxtext")
        except importlib.metadata.PackageNotFoundError:
            return f"maxtext is not installed ({INSTALL_HINT})"
        if version != MAXTEXT_VERSION:
            return f"maxtext {version} is installed; the adapter needs {MAXTEXT_VERSION}"
        return None

    def config(
        self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32
    ) -> MaxTextConfig:
        """The model of ``size`` with the given layer layout and compute dtype.

        ``tiny`` is ``model_name`` shrunk by :attr:`overrides`; a production size is its
        yml as shipped, with its workload's :attr:`production` keys, sharded by its own
        rules (:meth:`axis_rules`).
        """
        if size not in self.sizes:
            raise ValueError(f"{self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        if size == self.device_size:
            overrides = {"override_model_config": True, **_TINY, **self.overrides}
            return MaxTextConfig.create(
                self.model_name, overrides, scan_layers=scan_layers, dtype=dtype
            )
        overrides = {"override_model_config": True, **self.production.get(size, {})}
        return MaxTextConfig.create(size, overrides, scan_layers=scan_layers, dtype=dtype)

    def linen_module(self, config: MaxTextConfig) -> nn.Module:
        """MaxText's ``TransformerLinenPure`` for ``config``."""
        from conformance_models.maxtext.modules import linen_transformer

        return linen_transformer(config)

    def nnx_module(self, config: MaxTextConfig, rngs: nnx.Rngs) -> nnx.Module:
        """MaxText's NNX ``Transformer`` for ``config``."""
        from conformance_models.maxtext.modules import nnx_transformer

        return nnx_transformer(config, rngs)

    def batch(self, config: MaxTextConfig, batch_size: int, seed: int = 0) -> Batch:
        """A padded batch of :data:`SEQ_LEN` tokens per row (segment id 0 on padding)."""
        vocab = hyperparameters(config, "linen").vocab_size
        return make_batch(vocab, SEQ_LEN, batch_size, seed)

    def train_kwargs(self, config: MaxTextConfig) -> Mapping[str, Any]:
        """Train with dropout enabled (applied only when the config's rate is nonzero)."""
        del config
        return {"deterministic": False}

    def with_mesh(self, config: MaxTextConfig, mesh: jax.sharding.Mesh) -> MaxTextConfig:
        """``config`` whose modules constrain activations on ``mesh``'s devices.

        MaxText names its mesh axes itself (``mesh_axes``: data, stage, fsdp, tensor, ...);
        the module mesh holds ``mesh``'s devices in the same arrangement, each of its
        axes at its size and every other MaxText axis at size 1.
        """
        names = tuple(hyperparameters(config, "linen").mesh_axes)
        foreign = [name for name in mesh.axis_names if name not in names]
        if foreign:
            raise FamilyError(
                f"{self.name}: mesh axes {foreign} are not MaxText mesh axes ({', '.join(names)})"
            )
        order = sorted(range(len(mesh.axis_names)), key=lambda i: names.index(mesh.axis_names[i]))
        shape = tuple(mesh.shape.get(name, 1) for name in names)
        devices = np.transpose(mesh.devices, order).reshape(shape)
        module_mesh = jax.sharding.Mesh(
            devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)
        )
        return dataclasses.replace(config, mesh=module_mesh)

    def variant(
        self, config: MaxTextConfig, *, remat: bool = False, dropout: float = 0.0
    ) -> MaxTextConfig:
        """``remat``: MaxText's ``remat_policy`` ``full`` instead of ``minimal``."""
        return dataclasses.replace(config, remat=remat or config.remat, dropout_rate=dropout)

    def aqt_config(self, config: MaxTextConfig, mode: str) -> MaxTextConfig:
        """MaxText's AQT int8 (``quantization: int8``) in ``mode``, rounding to nearest."""
        if mode not in ("train", "convert", "serve"):
            raise FamilyError(f"{self.name}: no AQT mode {mode!r}; modes: train, convert, serve")
        return dataclasses.replace(config, aqt_mode=mode)

    def fp8_config(self, config: MaxTextConfig) -> MaxTextConfig:
        """MaxText's ``quantization: fp8`` (Flax's ``Fp8DirectDotGeneralOp``)."""
        return dataclasses.replace(config, fp8=True)

    def vocab_tiling_config(self, config: MaxTextConfig, tiles: int) -> MaxTextConfig:
        """MaxText's ``num_vocab_tiling: tiles``.

        The loss is MaxText's own ``vocab_tiling_linen_loss`` or ``vocab_tiling_nnx_loss``.
        """
        return dataclasses.replace(config, vocab_tiles=tiles)

    def layer_stack_rules(self, config: MaxTextConfig) -> PathRules:
        r"""MaxText stacks ``decoder/<stack>_<i>/`` into ``decoder/<stack>/`` on axis 1.

        ``<stack>`` is ``layers``, or ``dense_layers`` and ``moe_layers`` for DeepSeek.
        """
        del config
        return ((r"^decoder/(?P<stack>[a-z_]+?)_(?P<layer>\d+)/", r"decoder/\g<stack>/"),)

    def quantization_scope(self, config: MaxTextConfig) -> QuantScope:
        """The scope of MaxText's own Qwix rule (``use_qwix_quantization``): decoder layers."""
        del config
        return QuantScope(module_path="decoder/.*layers.*", op_names=("dot_general",))

    def logical_axis_rules(self) -> LogicalRules:
        """MaxText's own rules for the tiny model: ``base.yml`` merged with its yml."""
        return _rules(self.config(self.device_size, scan_layers=False))

    def axis_rules(self, config: MaxTextConfig) -> LogicalRules:
        """MaxText's own rules for ``config``: ``base.yml`` merged with its model's yml."""
        return _rules(config)


def _rules(config: MaxTextConfig) -> LogicalRules:
    """The logical-axis rules MaxText resolves for ``config``."""
    return tuple(
        (name, tuple(target) if isinstance(target, list) else target)
        for name, target in hyperparameters(config, "linen").logical_axis_rules
    )


_BF16_ROUNDED = (
    "MaxText's attend() (layers/embeddings.py) casts the tied embedding table to bfloat16 "
    "even in a float32 model, so the token-embedding gradient is bf16-rounded"
)
_BF16_ATTEND = (
    _BF16_ROUNDED + " and is not additive over micro-batches (both backends alike; up to "
    "2.5e-4 apart on 4 micro-batches)"
)
_PARTITIONED = (
    "on data=2,fsdp=2,tensor=2 one step's attention-projection gradients differ from the "
    "same step on one device by up to {gap} ({leaf}), on both backends alike and with "
    "Shardy on or off, while fsdp=8 agrees with one device: the model computes "
    "differently when partitioned on the 3-axis mesh (sharding_invariance), not a "
    "Linen/NNX divergence. With norm scales split over 'fsdp' (logical_axis_rules "
    "[['norm', 'fsdp']], llama2-7b's own setting) instead of MaxText's default 'tensor' it "
    "agrees with one device to 1e-7; XLA's CPU partitioner miscomputes a plain matmul "
    "between these layouts (tests/test_upstream.py::"
    "test_matmul_into_a_batch_split_over_two_axes)"
)
_PTQ_LINEN = (
    "qwix 0.1.8's PTQ looks for a weight only among the current Linen module's own "
    "top-level params (utils/flax_util.py find_param); MaxText's Linen decoder layers are "
    "NNX layers bridged by to_linen, whose params lie nested below that module, so on "
    "Linen no decoder-layer kernel becomes qvalue/scale ({leaves} stay float in every "
    "layer) while NNX quantizes each one"
)


def _ptq_divergences(leaves: str) -> dict[str, str]:
    """PTQ's parameter layout and forward fail alike: Linen kernels are never quantized."""
    reason = _PTQ_LINEN.format(leaves=leaves)
    return {"quant_params[ptq]": reason, "quant_forward[ptq]": reason}


_MOE_AQT = (
    "the routed MoE's dense path (layers/moe.py aqt_einsum) calls self.quant.einsum(...), a "
    "Linen AqtEinsum built at call time inside an NNX module. "
)
_MOE_AQT_CALL = _MOE_AQT + (
    "Every AQT mode fails to run on both backends: Linen apply raises 'AqtDotGeneral_0 "
    "needs PRNG for \"params\"', NNX 'Can't call compact methods on unbound modules'"
)
_MOE_AQT_LAYOUT = _MOE_AQT + (
    "Linen's serve-mode init hoists its frozen kernels to the layer "
    "(decoder/moe_layers_0/AqtEinsum_{0,1,2}/AqtDotGeneral_0/qrhs/frozen/{qvalue,scale/0}, "
    "int8[4, 64, 64]); the NNX model has none of these 6 leaves"
)
_VOCAB_TILING = MappingProxyType(
    {
        "vocab_tiling": "maxtext 0.2.4's vocab-tiled losses (utils/vocabulary_tiling.py: "
        "vocab_tiling_linen_loss, vocab_tiling_nnx_loss) multiply the output head's gradient "
        "by the loss cotangent but not the hidden states' gradient, so with a mean loss the "
        "gradients below the output head come out too large: on gpt3 and llama2 exactly 92x, "
        "the number of real targets in the harness's batch (llama2's query kernel: 0.103 "
        "untiled, 9.49 tiled), about 92x on gemma2's local-attention query kernel and up "
        "to 154x on deepseek3; the loss itself is right, and both backends alike (tiled "
        "Linen and NNX agree to 1.1e-5)"
    }
)
_MOE_FP8 = (
    "the routed MoE's dense path (layers/moe.py aqt_einsum) builds its einsum at call time "
    "from the quantization, for FP8 a Linen module (quantizations._Fp8EinsumWrapper around "
    "nn.Fp8Einsum), inside an NNX module: Linen trains, NNX raises 'Can't call compact "
    "methods on unbound modules' in its first step"
)
_TINY = MappingProxyType({"base_num_decoder_layers": 2, "vocab_size": 256})
_SMALL_ATTENTION = MappingProxyType(
    {
        "base_emb_dim": 64,
        "base_num_query_heads": 4,
        "base_num_kv_heads": 2,
        "base_mlp_dim": 128,
        "head_dim": 16,
    }
)


class MaxTextGpt3(MaxTextFamily):
    """``gpt3-52k`` with two layers: learned positions, fused QKV with biases, tied logits."""

    name = "maxtext-gpt3"
    model_name = "gpt3-52k"
    sizes = ("tiny", "gpt3-175b")
    overrides = MappingProxyType({})
    known_divergences = MappingProxyType(
        {
            **_VOCAB_TILING,
            "grad_accumulation": _BF16_ATTEND,
            "sharding_invariance[fsdp8-scan]": "on fsdp8 with scanned layers one element of "
            "the token-embedding gradient is 1.06e-5 from one device's (atol 1e-5), on both "
            "backends alike: " + _BF16_ROUNDED + ", and another reduction order moves it by "
            "a rounding step",
            **_ptq_divergences("self_attention/{qkv_proj,out}/kernel and mlp/{wi,wo}/kernel"),
            "layout": "the key bias of the fused qkv_proj has a zero true gradient (softmax "
            "ignores a per-query shift), so its gradient is rounding noise, which Adam "
            "scales to steps of up to the learning rate; the noise, and so the step, differs "
            "between remat policies and between scanned and unrolled layers",
        }
    )


class MaxTextLlama2(MaxTextFamily):
    """A tiny ``llama2-7b``: 64 wide, 4 query and 2 key/value heads, SwiGLU."""

    name = "maxtext-llama2"
    model_name = "llama2-7b"
    sizes = ("tiny", "llama2-70b", "llama3.1-70b")
    production = MappingProxyType(
        {"llama2-70b": {"num_vocab_tiling": 4}, "llama3.1-70b": {"num_vocab_tiling": 4}}
    )
    overrides = _SMALL_ATTENTION
    known_divergences = MappingProxyType(
        {
            **_VOCAB_TILING,
            **_ptq_divergences(
                "self_attention/{query,key,value,out}/kernel and mlp/{wi_0,wi_1,wo}/kernel"
            ),
            "grad_accumulation[scan]": "scanned layers: loss and gradients agree; one "
            "Adam-updated element of self_attention/out/kernel is 1.9e-5 apart (atol 1e-5): "
            "its gradient is near zero, and Adam scales that rounding noise up to a step",
        }
    )


class MaxTextDeepseek3(MaxTextFamily):
    """``deepseek3-tiny`` cut to 2 layers: 1 dense and 1 MoE layer of 4 experts, MLA."""

    name = "maxtext-deepseek3"
    model_name = "deepseek3-tiny"
    sizes = ("tiny", "deepseek3-671b")
    overrides = MappingProxyType(
        {
            "first_num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            # MaxText's own decode test serves MLA from the compressed cache.
            "mla_naive_kvcache": False,
            # The sparse (ragged-dot) MoE path does not trace on a mesh with tensor
            # parallelism in maxtext 0.2.4: the routed experts' output keeps the
            # tensor-split embedding (1, 16, 32) while the shared expert's is whole
            # (1, 16, 64). The dense path runs on every mesh.
            "sparse_matmul": False,
        }
    )
    known_divergences = MappingProxyType(
        {
            **_VOCAB_TILING,
            **_ptq_divergences(
                "self_attention/{wq_a,wq_b,wkv_a,wkv_b,out}/kernel, the dense mlp/{wi_0,wi_1,wo}"
                "/kernel, the MoE gate/kernel and shared_experts/{wi_0,wi_1,wo}/kernel"
            ),
            **dict.fromkeys(
                ("aqt_forward", "aqt_train_step", "aqt_convert", "aqt_serve"), _MOE_AQT_CALL
            ),
            "aqt_layout[loop]": _MOE_AQT_LAYOUT,
            "fp8_train_step": _MOE_FP8,
            "grad_accumulation": "4 micro-batches against the whole batch: "
            + _PARTITIONED.format(gap=0.11, leaf="self_attention/wkv_a/kernel"),
            "sharding_invariance[data2-fsdp2-tensor2]": _PARTITIONED.format(
                gap=0.11, leaf="self_attention/wkv_a/kernel"
            ),
        }
    )


class MaxTextGemma2(MaxTextFamily):
    """A tiny ``gemma2-2b``: local (sliding window 4) and global attention, soft caps.

    One decoder layer: MaxText's gemma2 layer is a local then a global attention block
    (``base_num_decoder_layers`` counts pairs), so one holds both kinds. A second pair
    doubled the cost of every unrolled-layer test; the other families' two layers cover
    layer stacking.
    """

    name = "maxtext-gemma2"
    model_name = "gemma2-2b"
    sizes = ("tiny", "gemma2-27b")
    overrides = MappingProxyType(
        {**_SMALL_ATTENTION, "sliding_window_size": 4, "base_num_decoder_layers": 1}
    )
    known_divergences = MappingProxyType(
        {
            **_VOCAB_TILING,
            **_ptq_divergences(
                "self_attention_{local,global}/{query,key,value,out}/kernel and "
                "mlp_{local,global}/{wi_0,wi_1,wo}/kernel"
            ),
            "grad_accumulation": "4 micro-batches against the whole batch: "
            + _PARTITIONED.format(gap=0.15, leaf="self_attention_local/query/kernel")
            + "; on fsdp=8, "
            + _BF16_ATTEND,
            "decode_consistency": "MaxText's sliding-window mask in autoregressive mode "
            "(layers/attention_op.py) compares cache slots (8 prefill slots, then the "
            "generated ones), not positions, so a local-attention layer's window is wrong "
            "for every right-padded row: decode step 0 differs from the full forward in every "
            "row by up to 3.6 in the logits, on both backends alike (decode itself agrees)",
            "layout[data2-fsdp2-tensor2-scan_layers]": "scanned against unrolled layers: "
            + _PARTITIONED.format(gap=0.15, leaf="self_attention_local/query/kernel"),
            "sharding_invariance[data2-fsdp2-tensor2]": _PARTITIONED.format(
                gap=0.15, leaf="self_attention_local/query/kernel"
            ),
        }
    )
