"""Faults in a mode's rewrite: NNX code that runs differently in one mode than in the other.

Tree mode: the families here tie gpt3's output head to its embedding by a shared
reference (``model.unembed = model.token_embed``), as NNX code in graph mode may; tree
mode cannot hold it, so each declares what it runs in tree mode
(:class:`~conformance.contract.TreeMode`).

Explicit sharding: a rewrite for explicit axes that lays an activation out on another
axis (the numbers agree), and a model written for auto axes alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from conformance.contract import (
    ExplicitSharding,
    Pair,
    PersistentState,
    TreeMode,
    with_features,
)
from conformance_models import common, nnx_layers
from conformance_models.gpt3 import nnx_model as gpt3_nnx
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.nnx_layers import constrain
from tests.faults.fault import Fault, Gpt3


def _rewritten_in(mode, build):
    """``features`` of a gpt3 whose NNX model in ``mode`` is ``build(family, config, rngs)``.

    ``mode`` is :class:`~conformance.contract.TreeMode` or
    :class:`~conformance.contract.ExplicitSharding`.
    """

    def features(self):
        rewrite = mode(lambda config, rngs: build(self, config, rngs))
        return with_features(Gpt3Family.features(self), rewrite)

    return features


def _swapped(kind, replacement):
    """A build of gpt3's NNX model (for :func:`_rewritten_in`) whose every ``kind`` node
    runs as ``replacement``, a subclass rewritten for the mode."""

    def build(family, config, rngs):
        model = Gpt3Family.nnx_module(family, config, rngs)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, kind):
                node.__class__ = replacement
        return model

    return build


class SharedHead(Gpt3Family):
    """gpt3 whose NNX model also holds its embedding as ``unembed``: a shared reference.

    Nothing is declared for tree mode, which cannot build it.
    """

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.unembed = model.token_embed
        return model


class TiedByAttendInTreeMode(SharedHead):
    """Benign: in tree mode, gpt3's own model, whose head calls ``token_embed.attend``."""

    def features(self):
        return with_features(super().features(), TreeMode(Gpt3Family().nnx_module))


class UntiedInTreeMode(SharedHead):
    """The tree-mode rewrite gives the head a parameter of its own: untied."""

    def features(self):
        return with_features(super().features(), TreeMode(self.untied))

    def untied(self, config, rngs):
        model = Gpt3Family.nnx_module(self, config, rngs)
        model.unembed = nnx.clone(model.token_embed)
        return model


class _HeadOfItsOwn(nnx_layers.Embed):
    """An embedding whose head (``attend``) is a table of its own, ``head``."""

    def attend(self, x):
        return self.head.attend(x)


def _untied_head(config, rngs):
    """gpt3's NNX model whose head no longer shares the embedding's table."""
    model = Gpt3Family().nnx_module(config, rngs)
    head = nnx.clone(model.token_embed)
    model.token_embed.__class__ = _HeadOfItsOwn
    model.token_embed.head = head
    return model


class UntiedAndAcceptedInTreeMode(Gpt3Family):
    """The tree-mode rewrite unties the head, and the family accepts its new table.

    The parameters then compare equal, and so do the logits (the head starts as a copy
    of the embedding); the train step does not: graph mode's embedding gradient holds
    the head's share, tree mode's does not.
    """

    def features(self):
        accept = (("token_embed/head/embedding", "token_embed/embedding"),)
        return with_features(super().features(), TreeMode(_untied_head, accept=accept))


class AcceptsWhatTreeModeLacks(Gpt3Family):
    """``TreeMode(accept=...)`` names a parameter the model in tree mode does not hold."""

    def features(self):
        accept = (("unembed/embedding", "token_embed/embedding"),)
        return with_features(super().features(), TreeMode(accept=accept))


class _CountingGpt3(gpt3_nnx.Gpt3):
    """gpt3 that counts its calls in a ``BatchStat``."""

    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, *args, **kwargs):
        self.calls[...] += 1
        return super().__call__(*args, **kwargs)


class _NotCountingGpt3(_CountingGpt3):
    """The same model rewritten for tree mode, its count no longer updated."""

    def __call__(self, *args, **kwargs):
        return gpt3_nnx.Gpt3.__call__(self, *args, **kwargs)


class CountDroppedInTreeMode(Gpt3Family):
    """gpt3 counting its calls as persistent state; its tree-mode rewrite stops counting."""

    nnx_decoder = _CountingGpt3

    def features(self):
        persistent = PersistentState(lambda: (nnx.BatchStat,))
        rewrite = TreeMode(lambda config, rngs: _NotCountingGpt3(config, rngs=rngs))
        return with_features(super().features(), persistent, rewrite)


class _HiddenSequenceOnTensor(gpt3_nnx.Mlp):
    def __call__(self, x):
        swapped = ("activation_batch", "activation_mlp", "activation_length")
        out = self.wo(constrain(jax.nn.gelu(self.wi(x)), swapped, self.config))
        return constrain(out, common.ACTIVATION_EMBED, self.config)


class MlpHiddenOnSequenceWhenExplicit(Gpt3Family):
    """The explicit-axes rewrite resolves the MLP hidden's ``tensor`` to its sequence.

    Otherwise the hidden ``[batch, seq, mlp]`` is split over ``tensor`` on ``mlp``; the
    rewrite names its axes in another order, so ``tensor`` splits the sequence and the
    ``mlp`` dimension is whole. Every number agrees: only the layout moves.
    """

    features = _rewritten_in(ExplicitSharding, _swapped(gpt3_nnx.Mlp, _HiddenSequenceOnTensor))


class MlpHiddenOnSequenceInTreeMode(Gpt3Family):
    """The tree-mode rewrite resolves the MLP hidden's ``tensor`` to its sequence."""

    features = _rewritten_in(TreeMode, _swapped(gpt3_nnx.Mlp, _HiddenSequenceOnTensor))


class _ExactGelu(gpt3_nnx.Mlp):
    def __call__(self, x):
        hidden = jax.nn.gelu(self.wi(x), approximate=False)
        return self.wo(constrain(hidden, common.ACTIVATION_MLP, self.config))


class ExactGeluWhenExplicit(Gpt3Family):
    """The explicit-axes rewrite of the MLP computes the exact GELU, not the tanh one.

    A layer rewritten for a mode is a chance to change what it computes: the logits
    move by about 1e-3 while every layout agrees.
    """

    features = _rewritten_in(ExplicitSharding, _swapped(gpt3_nnx.Mlp, _ExactGelu))


_GATHERED = nnx_layers.gathered


def _gathered_without_gradient(kernel, x, num_in=0):
    """The explicit-axes weight gather with its gradient cut: the forward is unchanged."""
    found = _GATHERED(kernel, x, num_in)
    return found if found is kernel else jax.lax.stop_gradient(found)


class _CacheIndexKept(nnx_layers.KVCache):
    """A KV cache rewritten for a mode that writes keys and values but keeps its index."""

    def __call__(self, k, v, segment_ids, mode):
        if mode == "forward":
            return super().__call__(k, v, segment_ids, mode)
        written, attended = common.serve_cache(
            mode, (self.key[...], self.value[...]), self.index[...], k, v, segment_ids
        )
        self.key[...], self.value[...] = written[:2]
        return attended


_with_index_kept = _swapped(nnx_layers.KVCache, _CacheIndexKept)


class CacheIndexKeptInTreeMode(Gpt3Family):
    """gpt3's tree-mode rewrite stops advancing the KV cache's index: decoding overwrites."""

    features = _rewritten_in(TreeMode, _with_index_kept)


class CacheIndexKeptWhenExplicit(Gpt3Family):
    """gpt3's rewrite for explicit axes stops advancing the KV cache's index."""

    features = _rewritten_in(ExplicitSharding, _with_index_kept)


def _embedding_at_ten_times(family, config, rngs):
    model = Gpt3Family.nnx_module(family, config, rngs)
    embedding = model.token_embed.embedding
    embedding.set_value(embedding.get_value() * 10.0)
    return model


class EmbeddingInitScaleInTreeMode(Gpt3Family):
    """gpt3's tree-mode rewrite initialises the token embedding at ten times the scale."""

    features = _rewritten_in(TreeMode, _embedding_at_ten_times)


class EmbeddingInitScaleWhenExplicit(Gpt3Family):
    """gpt3's rewrite for explicit axes initialises the token embedding at ten times the scale."""

    features = _rewritten_in(ExplicitSharding, _embedding_at_ten_times)


def _wi_replicated(family, config, rngs):
    """gpt3's NNX model whose MLP input kernels carry no logical axis names: replicated.

    The rewrite built them without ``nnx.with_partitioning``, as a hand-written layer may.
    """
    model = Gpt3Family.nnx_module(family, config, rngs)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, gpt3_nnx.Mlp):
            node.wi.kernel = nnx.Param(node.wi.kernel[...])
    return model


class KernelReplicatedInTreeMode(Gpt3Family):
    """The tree-mode rewrite loses the MLP input kernel's sharding: replicated everywhere."""

    features = _rewritten_in(TreeMode, _wi_replicated)


class KernelReplicatedWhenExplicit(Gpt3Family):
    """The explicit-axes rewrite loses the MLP input kernel's sharding."""

    features = _rewritten_in(ExplicitSharding, _wi_replicated)


def _without_remat(family, config, rngs):
    """gpt3's NNX model built as if ``remat`` were off: the same numbers, activations kept."""
    return Gpt3Family.nnx_module(family, dataclasses.replace(config, remat=False), rngs)


class RematDroppedInTreeMode(Gpt3Family):
    """The tree-mode rewrite ignores ``remat``: every block's activations kept for backward."""

    features = _rewritten_in(TreeMode, _without_remat)


class OutBiasDroppedWhenExplicit(Gpt3Family):
    """The explicit-axes rewrite builds the MLP output projection without its bias."""

    def features(self):
        return with_features(super().features(), ExplicitSharding(self.unbiased))

    def unbiased(self, config, rngs):
        model = Gpt3Family.nnx_module(self, config, rngs)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, gpt3_nnx.Mlp):
                node.wo.bias = nnx.data(None)
        return model


def _lookup_by_take(self, ids):
    """Embed's lookup as written for auto axes only: jax cannot lay the rows out alone."""
    return jnp.take(self.embedding[...].astype(self.dtype), ids, axis=0)


class EmbedByOneHotWhenExplicit(Gpt3Family):
    """Benign: on explicit axes, the embedding lookup is a one-hot contraction.

    Each row is ``1 * row + 0 * the others``: the same numbers, laid out as the
    residual stream is constrained right after.
    """

    def features(self):
        return with_features(super().features(), ExplicitSharding(self.by_one_hot))

    def by_one_hot(self, config, rngs):
        model = Gpt3Family.nnx_module(self, config, rngs)
        for embed in (model.token_embed, model.pos_embed):
            embed.__class__ = _OneHotEmbed
        return model


class _OneHotEmbed(nnx_layers.Embed):
    def __call__(self, ids):
        table = self.embedding[...].astype(self.dtype)
        one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=self.dtype)
        return nnx_layers.explicit_dot(one_hot, table, 1)


FAULTS = (
    Fault(
        SharedHead(),
        "forward",
        ("NNX tree mode raised ValueError", "Duplicate", "not of both"),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        UntiedInTreeMode(),
        "forward",
        (
            "NNX graph mode and NNX tree mode hold different parameters",
            "unembed/embedding: NNX tree mode has it",
        ),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        EmbeddingInitScaleInTreeMode(),
        "init",
        ("token_embed/embedding: NNX graph mode mean=", "NNX tree mode mean="),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        EmbeddingInitScaleWhenExplicit(),
        "init",
        ("token_embed/embedding: NNX auto sharding mean=", "NNX explicit sharding mean="),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        CacheIndexKeptInTreeMode(),
        "decode",
        ("decode step 0 of 8", "NNX graph mode", "NNX tree mode", "index"),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        CacheIndexKeptWhenExplicit(),
        "decode",
        ("decode step 0 of 8", "NNX auto sharding", "NNX explicit sharding", "index"),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        ExactGeluWhenExplicit(),
        "forward",
        (
            "NNX auto sharding params -> NNX explicit sharding on mesh data2-fsdp2-tensor2",
            "logits",
            "mlp",
        ),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        Gpt3(),
        "train_step",
        ("step 1 of 3", "grads/layers/0/mlp/wi/kernel", "NNX explicit sharding"),
        model_patch=(nnx_layers, "gathered", _gathered_without_gradient),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        SharedHead(),
        "tree_mode",
        (
            "NNX graph mode holds shared references, which tree mode cannot hold: "
            "Embed at token_embed and unembed",
            "Declare the model rewritten without them as TreeMode(nnx_module=...)",
        ),
    ),
    Fault(
        UntiedInTreeMode(),
        "structure",
        (
            "1 difference(s) (NNX graph mode 28 leaves, NNX tree mode 29 leaves)",
            "unembed/embedding: NNX tree mode has it (float32[256, 64]); NNX graph mode does not",
        ),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        KernelReplicatedInTreeMode(),
        "sharding",
        ("layers/0/mlp/wi/kernel: NNX graph mode P(", "!= NNX tree mode P() (logical None)"),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        KernelReplicatedWhenExplicit(),
        "sharding",
        (
            "layers/0/mlp/wi/kernel: NNX auto sharding P(",
            "!= NNX explicit sharding P() (logical None)",
        ),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        OutBiasDroppedWhenExplicit(),
        "sharding",
        ("NNX auto sharding", "layers/0/mlp/wo/bias", "NNX explicit sharding"),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        MlpHiddenOnSequenceInTreeMode(),
        "activation_sharding",
        (
            "activation shardings differ",
            "layers/0/mlp",
            "NNX graph mode",
            "NNX tree mode",
            "likely cause: a partitioning change",
        ),
        mesh_axes=("tensor",),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        MlpHiddenOnSequenceWhenExplicit(),
        "activation_sharding",
        (
            "activation shardings differ",
            "layers/0/mlp",
            "NNX auto sharding",
            "NNX explicit sharding",
        ),
        mesh_axes=("tensor",),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        RematDroppedInTreeMode(),
        "cost",
        (
            "NNX tree mode costs more than NNX graph mode on mesh",
            "train_step (remat): temp_bytes NNX tree mode",
        ),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        KernelReplicatedWhenExplicit(),
        "cost",
        (
            "NNX explicit sharding costs more than NNX auto sharding on mesh",
            "train_step: argument_bytes NNX explicit sharding",
        ),
        mesh_axes=("fsdp",),
        pair=Pair.AUTO_EXPLICIT,
    ),
    Fault(
        UntiedAndAcceptedInTreeMode(),
        "train_step",
        ("step 1 of 3", "grads/token_embed/embedding", "NNX tree mode"),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        AcceptsWhatTreeModeLacks(),
        "tree_mode",
        (
            "TreeMode(accept=...) of gpt3 does not fit the rewrite",
            "unembed/embedding: accepted as a parameter of tree mode only, which it is not",
        ),
    ),
    Fault(
        CountDroppedInTreeMode(),
        "resume_conversion",
        (
            "step 3 of 4",
            "NNX tree mode resumed from NNX graph mode's checkpoint of step 2",
            "state/model/calls",
        ),
        pair=Pair.GRAPH_TREE,
    ),
    Fault(
        CountDroppedInTreeMode(),
        "tree_mode",
        ("step 2, tree mode resumed from NNX graph mode's checkpoint", "state/model/calls"),
    ),
    Fault(
        MlpHiddenOnSequenceWhenExplicit(),
        "explicit_sharding",
        (
            "activation layouts differ on mesh data2-fsdp2-tensor2",
            "NNX auto sharding",
            "NNX explicit sharding",
            "likely cause: a partitioning change",
        ),
        mesh_axes=("tensor",),
    ),
    Fault(
        Gpt3(),
        "explicit_sharding",
        (
            "NNX explicit sharding raised ShardingTypeError",
            "out_sharding",
            "NNX auto sharding got through the same calls",
        ),
        model_patch=(nnx_layers.Embed, "__call__", _lookup_by_take),
    ),
)
