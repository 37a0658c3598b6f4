"""Planted faults: deliberate Linen/NNX divergences, each injected into one side.

Every fault is a built-in family with one method overridden, so it breaks exactly one
thing on one backend. ``FAULTS`` pairs each with the check that must catch it and the
words (leaf path first) the failure report must contain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from aqt.jax.v2 import config as aqt_config
from flax import nnx
from jax.sharding import PartitionSpec as P
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.utils import flax_util as qwix_flax_util

from conformance.core.trees import restack as checkpoints_restack
from conformance.families import Family, QuantScope
from conformance.runtime import checkpoints, decoding, quant, training
from conformance.runtime.checkpoints import cast_counters as checkpoints_cast_counters
from conformance.runtime.decoding import decode_positions as decoding_positions
from conformance.runtime.training import NnxTrainer, NnxTrainState, split_batch
from conformance_models import common, nnx_layers
from conformance_models.config import TransformerConfig
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama import nnx_model as llama_nnx
from conformance_models.llama.family import LlamaFamily
from tests.contract.toyzoo.families import ToyMinimal


class _NnxConfigFault:
    """Build the NNX side from a config with some fields changed (Linen keeps the original)."""

    changes: ClassVar[dict[str, Any]] = {}

    def nnx_module(self, config: Any, rngs: nnx.Rngs) -> nnx.Module:
        return super().nnx_module(dataclasses.replace(config, **self.changes), rngs)


class DroppedBias(Gpt3Family):
    """NNX block 0's MLP input projection has no bias."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.wi.bias = nnx.data(None)
        return model


class StrayCounterBesideRngs(Gpt3Family):
    """NNX carries dropout RNG streams, which train states set aside, and a stray counter.

    Proves the RNG normalisation hides nothing else: the counter must still be reported.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(dataclasses.replace(config, dropout_rate=0.1), rngs)
        model.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
        return model


class IntermediateAtSetUp(LlamaFamily):
    """NNX runs one forward while being built (to check shapes), outside ``nnx.capture``."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        batch = self.batch(config, 1)
        model(batch.tokens, batch.positions, batch.segment_ids)
        return model


class TransposedKernel(LlamaFamily):
    """NNX stores block 1's MLP down projection as [embed, mlp] instead of [mlp, embed]."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        kernel = model.layers[1].mlp.down.kernel
        kernel.set_value(kernel.get_value().T)
        return model


class MissingParameter(LlamaFamily):
    """NNX has no output head (a tied head slipped in during the port)."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.lm_head = nnx.data(None)
        return model


class NormScaleNotParam(LlamaFamily):
    """NNX block 0's MLP norm holds its scale as a plain ``nnx.Variable``, not ``nnx.Param``."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        norm = model.layers[0].mlp_norm
        norm.scale = nnx.Variable(norm.scale.get_value())
        return model


class NormEpsilon(_NnxConfigFault, LlamaFamily):
    """NNX RMSNorm epsilon is 1e-5 instead of 1e-6."""

    changes: ClassVar[dict[str, Any]] = {"norm_eps": 1e-5}


class RopeBase(_NnxConfigFault, LlamaFamily):
    """NNX RoPE base is 20000 instead of 10000."""

    changes: ClassVar[dict[str, Any]] = {"rope_base": 20_000.0}


class SilentBfloat16(LlamaFamily):
    """NNX block 1's MLP output projection computes in bfloat16 under a float32 config."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[1].mlp.down.dtype = jnp.bfloat16
        return model


class ToyNormEpsilon(ToyMinimal):
    """A third-party family that sows nothing: NNX block 1's LayerNorm epsilon is 1e-2."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.blocks[1].norm.epsilon = 1e-2
        return model


class NanOnOneSide(_NnxConfigFault, LlamaFamily):
    """NNX RMSNorm epsilon is negative: rsqrt of a negative number gives NaN on NNX only."""

    changes: ClassVar[dict[str, Any]] = {"norm_eps": -1.0}


class SpecOnWrongAxis(Gpt3Family):
    """NNX annotates block 0's MLP input kernel ("mlp", "embed") instead of ("embed", "mlp")."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.wi.kernel.set_metadata(out_sharding=("mlp", "embed"))
        return model


@dataclasses.dataclass(frozen=True)
class _MeshedConfig(TransformerConfig):
    """A built-in config that also carries the device mesh (``Family.with_mesh``)."""

    mesh: Any = None


class _RowParallelDownWrongAxis(llama_nnx.Mlp):
    """A hand-written row-parallel down projection whose partial sums meet over "data"."""

    mesh: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(self.gate(x)) * self.up(x)

        def partial_products(h: jax.Array, kernel: jax.Array) -> jax.Array:
            return jax.lax.psum(h @ kernel, "data")  # the fault: the sum belongs on "tensor"

        return jax.shard_map(
            partial_products,
            mesh=self.mesh,
            in_specs=(P(None, None, "tensor"), P("tensor", None)),
            out_specs=P(),
            check_vma=False,
        )(hidden, self.down.kernel[...])


class PsumOverWrongAxis(LlamaFamily):
    """NNX block 0's MLP sums its row-parallel partial products over the wrong mesh axis.

    On one device every axis has size 1 and the result is right; on ``data=2,fsdp=2,
    tensor=2`` half of the products are dropped and the other half doubled. Only a
    partitioned run shows it: the fault of ``sharding_invariance``, and the partitioning
    problem that cross-backend reports must not blame on Linen or NNX.
    """

    def config(self, size, *, scan_layers, dtype=jnp.float32):
        base = super().config(size, scan_layers=scan_layers, dtype=dtype)
        return _MeshedConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def with_mesh(self, config, mesh):
        return dataclasses.replace(config, mesh=mesh)

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        if config.mesh is not None:
            mlp = model.layers[0].mlp
            mlp.__class__ = _RowParallelDownWrongAxis
            mlp.mesh = config.mesh
        return model


class MisspelledLogicalAxis(LlamaFamily):
    """NNX names a logical axis "mpl" on block 0's MLP up projection."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.up.kernel.set_metadata(out_sharding=("embed", "mpl"))
        return model


class IndivisibleVocab(Gpt3Family):
    """Both sides use gpt3's raw vocabulary of 50257, which no tensor axis divides."""

    def config(self, size, *, scan_layers, dtype=jnp.float32):
        config = super().config(size, scan_layers=scan_layers, dtype=dtype)
        return dataclasses.replace(config, vocab_size=50257)


class EmbeddingInitScale(Gpt3Family):
    """NNX initialises the token embedding with std 0.2 instead of 0.02."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        embedding = model.token_embed.embedding
        embedding.set_value(embedding.get_value() * 10.0)
        return model


class Fp8DroppedInOneProjection(LlamaFamily):
    """NNX block 0's MLP up projection computes in float32 under an FP8 config.

    It keeps its FP8 scales and amax histories, which then never see a value.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.up.fp8 = False
        return model


class Llama(LlamaFamily):
    """An unchanged llama, for faults planted by a patch instead."""


class Gpt3(Gpt3Family):
    """An unchanged gpt3, for faults planted by a patch instead."""


def forward_without_capture(model, batch, train_kwargs):
    """The NNX training forward called directly: its sown ``hidden_states`` stay on the model."""
    return model(batch.tokens, batch.positions, batch.segment_ids, **train_kwargs)


_rms_norm_call = llama_nnx.RMSNorm.__call__


def _sows_norm_stats(self, x):
    """RMSNorm that also records its input's scale under a string name, as MaxText did."""
    self.sow("norm_stats", "rms", jnp.sqrt(jnp.mean(jnp.square(x))))
    return _rms_norm_call(self, x)


def drop_last_micro_batch(grad_fn, batch, micro_batches, sharding=None):
    """``accumulate`` that forgets the last micro-batch when there is more than one."""
    micros = split_batch(batch, micro_batches)
    micros = micros[:-1] if len(micros) > 1 else micros
    outputs = [grad_fn(m) for m in micros]
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outputs)


def unmasked_loss(logits, batch):
    """``masked_token_loss`` that counts padding and each row's last target too."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch.targets
    )
    return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)


_tiled_token_loss = common.tiled_token_loss


def _tiled_loss_detached(head, hidden, targets, weights, tiles):
    """``tiled_token_loss`` whose slices stop the gradient: the decoder learns nothing."""
    return _tiled_token_loss(head, jax.lax.stop_gradient(hidden), targets, weights, tiles)


class _ReshardedTrainState(NnxTrainState):
    """NNX optimizer state whose mu for block 0's MLP up kernel is annotated on swapped axes."""

    def __init__(self, model, tx):
        super().__init__(model, tx)
        for path, node in nnx.iter_graph(self.optimizer):
            if path[-6:] == ("mu", "layers", 0, "mlp", "up", "kernel"):
                node.set_metadata(out_sharding=("mlp", "embed"))


class RenamedLeaf(LlamaFamily):
    """NNX names the final norm ``norm_f``: a checkpoint of the real llama must not load."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.norm_f = model.final_norm
        del model.final_norm
        return model


def _drops_final_norm(state, mapping):
    """The converter's rename step, losing every ``final_norm/scale`` leaf."""
    renamed = {mapping.get(p, p): v for p, v in state.items()}
    return {p: v for p, v in renamed.items() if not p.endswith("final_norm/scale")}


def _swaps_moments(state, mapping):
    """The converter's rename step, writing Adam's mu as nu and nu as mu."""
    swap = {"/mu/": "/nu/", "/nu/": "/mu/"}

    def swapped(path):
        for old, new in swap.items():
            if old in path:
                return path.replace(old, new)
        return path

    return {swapped(mapping.get(p, p)): v for p, v in state.items()}


def _stacks_on_next_axis(flat, table, to_scan, axis=0):
    """``restack`` that stacks layers on the axis after the family's ``layer_stack_axis``."""
    if not to_scan:
        return checkpoints_restack(flat, table, to_scan, axis)
    stacked = checkpoints_restack(flat, table, to_scan, axis)
    stacked_paths = tuple(table)
    return {
        p: np.moveaxis(v, axis, axis + 1) if p.endswith(stacked_paths) and np.ndim(v) > 1 else v
        for p, v in stacked.items()
    }


def _loses_step(state, target):
    """``cast_counters`` that also resets the step counter to 0."""
    cast = checkpoints_cast_counters(state, target)
    return {p: np.zeros_like(v) if p == "optimizer/step" else v for p, v in cast.items()}


_serve_call = nnx_layers.KVCache.__call__
_init_cache = nnx_layers.KVCache.init


def _never_writes_cache(self, k, v, segment_ids, mode):
    """NNX ``KVCache`` that attends with the new keys but never stores them."""
    if mode == "forward":
        return _serve_call(self, k, v, segment_ids, mode)
    before = self.key[...], self.value[...]
    out = _serve_call(self, k, v, segment_ids, mode)
    self.key[...], self.value[...] = before
    return out


def _index_off_by_one(self, k, v, segment_ids, mode):
    """NNX ``KVCache`` whose prefill leaves the index one past each prompt's end."""
    out = _serve_call(self, k, v, segment_ids, mode)
    if mode == "prefill":
        self.index[...] = self.index[...] + 1
    return out


def _prefill_without_causal_mask(self, k, v, segment_ids, mode):
    """NNX ``KVCache`` whose prefill lets every prompt token see the whole prompt."""
    keys, values, mask = _serve_call(self, k, v, segment_ids, mode)
    if mode == "prefill":
        real = segment_ids != 0
        mask = real[:, None, :, None] & real[:, None, None, :]
    return keys, values, mask


def _bfloat16_cache(self, batch_size, stacked=None):
    """NNX ``KVCache.init`` that stores keys in bfloat16 under a float32 config."""
    _init_cache(self, batch_size, stacked)
    self.key = self.key.replace(self.key[...].astype(jnp.bfloat16))


def _positions_not_advanced(lengths, step):
    """The serving loop's positions, stuck at the first decode step's."""
    del step
    return decoding_positions(lengths, 0)


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


_how_to_quantize = qwix_dot_general.get_how_to_quantize


def _nnx_scale_on_input_axes(**kwargs):
    """Qwix's how-to-quantize with NNX kernels scaled per input channel, not per output."""
    how = _how_to_quantize(**kwargs)
    if kwargs["for_lhs"] or not isinstance(qwix_flax_util.get_current_module(), nnx.Module):
        return how
    contracting = kwargs["dimension_numbers"][0][1]
    return dataclasses.replace(how, channelwise_axes=sorted(contracting))


def _keeps_transients(model):
    """``strip_transients`` that leaves Qwix's tracing-forward intermediates in place."""
    del model


def _requantize(dense: nnx.Module, **fully_quantized: Any) -> None:
    """Give an NNX ``DenseGeneral``'s bridged AQT layer another ``fully_quantized`` config."""
    options = {"fwd_bits": 8, "bwd_bits": 8, "use_stochastic_rounding": False} | fully_quantized
    bridged = dense.AqtDotGeneral_0
    bridged.to_nnx__module = bridged.to_nnx__module.clone(cfg=aqt_config.fully_quantized(**options))


class AqtDropped(_NnxConfigFault, Gpt3Family):
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


_restore = checkpoints.restore


def _zero_fills_qvalue(directory, target, shardings=None):
    """A restore that gives back every ``qvalue`` as zeros (the dtype and shape are right)."""
    restored = _restore(directory, target, shardings)
    return {p: jnp.zeros_like(v) if p.endswith("/qvalue") else v for p, v in restored.items()}


@dataclasses.dataclass(frozen=True)
class Fault:
    """A faulty family, the check that must catch it, and what its report must say.

    ``patch`` plants a fault in the harness or in a shared model layer instead (applied
    with ``monkeypatch`` around the check; the family is then a fresh unchanged
    instance, so no cached runner, trainer or decoder outlives the patch).
    """

    family: Family
    check: str
    expect: tuple[str, ...]
    size: str = "tiny"
    patch: tuple[Any, str, Any] | None = None
    layouts: tuple[bool, bool] = (False, False)
    quant: str | None = None
    mesh_axes: tuple[str, ...] = ()
    """Mesh axes the fault needs at size 2 or more to show (a partitioning fault)."""

    @property
    def id(self) -> str:
        """Test id: the fault's class name, or the check and the patched attribute."""
        if self.patch is not None:
            owner = getattr(self.patch[0], "__name__", "").rsplit(".", 1)[-1]
            return f"{self.check}:{owner}.{self.patch[1]}={self.patch[2].__name__.lstrip('_')}"
        return type(self.family).__name__


FAULTS = (
    Fault(DroppedBias(), "structure", ("layers/0/mlp/wi/bias: Linen has it",)),
    Fault(
        TransposedKernel(),
        "structure",
        ("layers/1/mlp/down/kernel: Linen float32[128, 64]", "NNX float32[64, 128]"),
    ),
    Fault(MissingParameter(), "structure", ("lm_head/kernel: Linen has it",)),
    Fault(
        NormScaleNotParam(),
        "structure",
        (
            "layers/0/mlp_norm/scale: Linen has it (as layers_0/mlp_norm/scale, float32[64]); "
            "NNX holds it as flax.nnx.variablelib.Variable, not nnx.Param: it will not be "
            "trained or checkpointed as a parameter",
        ),
    ),
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
        ("logits:", "first divergent module: layers_1/mlp/down (NNX layers/1/mlp/down)"),
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
    Fault(NanOnOneSide(), "forward", ("logits:", "non-finite on one side only")),
    Fault(
        SpecOnWrongAxis(),
        "sharding",
        # The specs depend on the mesh (P('fsdp', None) on fsdp8, P('fsdp', 'tensor') on 2x2x2).
        ("layers/0/mlp/wi/kernel: Linen P('fsdp', ", "!= NNX P("),
    ),
    Fault(
        MisspelledLogicalAxis(),
        "sharding",
        ("layers/0/mlp/up/kernel: logical axis 'mpl' has no rule",),
    ),
    Fault(
        IndivisibleVocab(),
        "sharding_topology",
        ("token_embed/embedding: dim 0 of size 50257 is split 8 ways",),
        size="6b",
    ),
    Fault(EmbeddingInitScale(), "init", ("token_embed/embedding: Linen mean=",)),
    Fault(
        StrayCounterBesideRngs(),
        "hygiene",
        ("NNX train step", "model/calls: flax.nnx.variablelib.BatchStat is not persistent state"),
    ),
    Fault(
        Llama(),
        "hygiene",
        (
            "NNX train step",
            "model/hidden_states: NNX has it",
            "model/hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate) "
            "is not persistent state",
        ),
        patch=(NnxTrainer, "forward", staticmethod(forward_without_capture)),
    ),
    Fault(
        Llama(),
        "state_hygiene",
        (
            "NNX model state after an eager forward is not the freshly built model's",
            "layers/0/attn_norm/rms: flax.nnx.variablelib.norm_stats appeared",
        ),
        patch=(llama_nnx.RMSNorm, "__call__", _sows_norm_stats),
    ),
    Fault(
        IntermediateAtSetUp(),
        "state_hygiene",
        (
            "the freshly built NNX model holds sown intermediates",
            "hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate): a forward "
            "at set-up",
        ),
    ),
    Fault(
        Llama(),
        "grad_accumulation",
        ("NNX one step", "loss:"),
        patch=(NnxTrainer, "accumulate", staticmethod(drop_last_micro_batch)),
    ),
    Fault(
        Llama(),
        "train_step",
        (
            "step 1 of 3",
            "loss:",
            "verdict: a Linen/NNX divergence: it shows on one device too, and partitioning "
            "changes neither side",
        ),
        patch=(NnxTrainer, "loss", staticmethod(unmasked_loss)),
    ),
    Fault(
        Llama(),
        "vocab_tiling",
        ("Linen one step on mesh", "untiled", "4 vocab tiles", "grads/layers/0/"),
        patch=(common, "tiled_token_loss", _tiled_loss_detached),
    ),
    Fault(
        Fp8DroppedInOneProjection(),
        "fp8_train_step",
        (
            "step 1 of 3",
            "state/model/layers/0/mlp/up/Fp8DirectDotGeneralOp_0/input_amax_history:",
        ),
    ),
    Fault(
        PsumOverWrongAxis(),
        "sharding_invariance",
        (
            "NNX on mesh data2-fsdp2-tensor2 against NNX on one device",
            "grads/layers/0/mlp/down/kernel: ",
            "NNX computes differently when partitioned on mesh data2-fsdp2-tensor2",
        ),
        mesh_axes=("data", "tensor"),
    ),
    Fault(
        PsumOverWrongAxis(),
        "train_step",
        (
            "grads/layers/0/mlp/down/kernel: ",
            "Linen on mesh data2-fsdp2-tensor2 agrees with itself on one device; NNX on mesh "
            "data2-fsdp2-tensor2 differs from itself on one device",
            "verdict: a partitioning problem, not a Linen/NNX divergence: NNX computes "
            "differently when partitioned on mesh data2-fsdp2-tensor2",
        ),
        mesh_axes=("data", "tensor"),
    ),
    Fault(
        Llama(),
        "optimizer_sharding",
        (
            "optimizer/opt_state/1/0/mu/layers/0/mlp/up/kernel: Linen P('fsdp', ",
            "!= NNX P(",
        ),
        patch=(training, "NnxTrainState", _ReshardedTrainState),
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("model/final_norm/scale: in the target, missing from the checkpoint",),
        patch=(checkpoints, "_rename", _drops_final_norm),
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        (
            "model/layers/mlp/gate/kernel: checkpoint float32[64, 2, 128]",
            "!= target float32[2, 64, 128]",
        ),
        patch=(checkpoints, "restack", _stacks_on_next_axis),
        layouts=(False, True),
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("next train step", "state/optimizer/opt_state/1/0/mu/"),
        patch=(checkpoints, "_rename", _swaps_moments),
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("next train step", "state/optimizer/step:"),
        patch=(checkpoints, "cast_counters", _loses_step),
    ),
    Fault(
        RenamedLeaf(),
        "restore",
        (
            "model/norm_f/scale: in the target, missing from the checkpoint",
            "model/final_norm/scale: in the checkpoint, not in the target",
        ),
    ),
    Fault(
        Llama(),
        "decode",
        (
            "decode step 0 of 8",
            "logits:",
            "the caches first differ after prefill",
            "layers/0/attn/kv_cache/key:",
            "verdict: a Linen/NNX divergence: it shows on one device too",
        ),
        patch=(nnx_layers.KVCache, "__call__", _never_writes_cache),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("NNX decode step 0 of 8", "vs the full forward", "logits:"),
        patch=(nnx_layers.KVCache, "__call__", _index_off_by_one),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("NNX prefill vs the full-sequence forward", "logits:"),
        patch=(nnx_layers.KVCache, "__call__", _prefill_without_causal_mask),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("Linen decode step 1 of 8", "vs the full forward", "logits:"),
        patch=(decoding, "decode_positions", _positions_not_advanced),
    ),
    Fault(
        Gpt3(),
        "decode_cache",
        (
            "layers/0/attn/kv_cache/key: Linen float32[8, 32, 4, 16]",
            "!= NNX bfloat16[8, 32, 4, 16]",
        ),
        patch=(nnx_layers.KVCache, "init", _bfloat16_cache),
    ),
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
        Gpt3(),
        "quant_params",
        (
            "layers/0/attn/qkv/kernel/array/scale: Linen float32[1, 3, 4, 16]",
            "!= NNX float32[64, 1, 1, 1]",
        ),
        patch=(qwix_dot_general, "get_how_to_quantize", _nnx_scale_on_input_axes),
        quant="ptq_int8",
    ),
    Fault(
        Gpt3(),
        "quant_hygiene",
        (
            "hidden_states: flax.nnx.variablelib.Intermediate (a sown intermediate) "
            "appeared with quantization",
        ),
        patch=(quant, "strip_transients", _keeps_transients),
        quant="qat_int8",
    ),
    Fault(
        Llama(),
        "quant_checkpoint",
        (
            "Linen ptq_int8 parameters after an orbax round trip",
            "layers_0/attn/k/kernel/array/qvalue",
        ),
        patch=(checkpoints, "restore", _zero_fills_qvalue),
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
        patch=(checkpoints, "restore", _zero_fills_qvalue),
    ),
)
