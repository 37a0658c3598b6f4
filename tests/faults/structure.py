"""Faults in what the sides are made of: leaves, shapes, shardings, initialisers."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama.family import LlamaFamily
from tests.faults.fault import Fault


class DroppedBias(Gpt3Family):
    """NNX block 0's MLP input projection has no bias."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.wi.bias = nnx.data(None)
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


class SpecOnWrongAxis(Gpt3Family):
    """NNX annotates block 0's MLP input kernel ("mlp", "embed") instead of ("embed", "mlp")."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.layers[0].mlp.wi.kernel.set_metadata(out_sharding=("mlp", "embed"))
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


class NnxRunsLinen(Gpt3Family):
    """NNX's model is the Linen model behind ``nnx.bridge.ToNNX``: equal numbers, one backend."""

    def nnx_module(self, config, rngs):
        model = nnx.bridge.ToNNX(self.linen_module(config), rngs=rngs)
        batch = self.batch(config, 1)
        return nnx.bridge.lazy_init(model, batch.tokens, batch.positions, batch.segment_ids)


FAULTS = (
    Fault(DroppedBias(), "structure", ("layers/0/mlp/wi/bias: Linen has it",)),
    Fault(
        NnxRunsLinen(),
        "provenance",
        (
            "a side runs other code than declared",
            "NNX built flax.nnx.bridge.wrappers.ToNNX (1 ToNNX; bridged: the other backend's "
            "model): 1 ToNNX module(s), the family declares 0 (it runs the other backend's code)",
        ),
    ),
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
)
