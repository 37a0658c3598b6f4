"""Faults in a tree-mode rewrite: NNX code that runs differently in tree mode than in graph.

The families here tie gpt3's output head to its embedding by a shared reference
(``model.unembed = model.token_embed``), as NNX code in graph mode may; tree mode cannot
hold it, so each declares what it runs in tree mode (:class:`~conformance.contract.TreeMode`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from conformance.contract import PersistentState, TreeMode, with_features
from conformance_models.gpt3 import nnx_model as gpt3_nnx
from conformance_models.gpt3.family import Gpt3Family
from tests.faults.fault import Fault


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
        CountDroppedInTreeMode(),
        "tree_mode",
        ("one train step on mesh", "state/model/calls"),
    ),
)
