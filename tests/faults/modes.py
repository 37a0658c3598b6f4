"""Faults in a mode's rewrite: NNX code that runs differently in one mode than in the other.

Tree mode: the families here tie gpt3's output head to its embedding by a shared
reference (``model.unembed = model.token_embed``), as NNX code in graph mode may; tree
mode cannot hold it, so each declares what it runs in tree mode
(:class:`~conformance.contract.TreeMode`).

Explicit sharding: a rewrite for explicit axes that lays an activation out on another
axis (the numbers agree), and a model written for auto axes alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from conformance.contract import ExplicitSharding, PersistentState, TreeMode, with_features
from conformance_models import common, nnx_layers
from conformance_models.gpt3 import nnx_model as gpt3_nnx
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.nnx_layers import constrain
from tests.faults.fault import Fault, Gpt3


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

    Auto axes split the hidden ``[batch, seq, mlp]`` over ``tensor`` on ``mlp``; the
    rewrite names its axes in another order, so ``tensor`` splits the sequence and the
    ``mlp`` dimension is whole. Every number agrees: only the layout moves.
    """

    def features(self):
        return with_features(super().features(), ExplicitSharding(self.swapped))

    def swapped(self, config, rngs):
        model = Gpt3Family.nnx_module(self, config, rngs)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, gpt3_nnx.Mlp):
                node.__class__ = _HiddenSequenceOnTensor
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
        "tree_mode",
        (
            "NNX graph mode holds shared references, which tree mode cannot hold: "
            "Embed at token_embed and unembed",
            "Declare the model rewritten without them as TreeMode(nnx_module=...)",
        ),
    ),
    Fault(
        UntiedInTreeMode(),
        "tree_mode",
        (
            "NNX tree mode builds the model differently from NNX graph mode",
            "unembed/embedding: parameter float32[256, 64] in tree mode only",
        ),
    ),
    Fault(
        UntiedAndAcceptedInTreeMode(),
        "tree_mode",
        ("one train step on mesh", "grads/token_embed/embedding"),
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
        "tree_mode",
        ("one train step on mesh", "state/model/calls"),
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
