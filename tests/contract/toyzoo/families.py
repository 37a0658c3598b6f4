"""The zoo's conformance families: one with no optional capability, one with them, one
written as Flax's own examples are (decoding by config, token by token; logits that
predict the current token), a mixture of experts with a load-balancing loss, and one
whose modules take and return their KV cache as a value (decoding with a prefill, or
token by token)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from conformance.families import (
    Batch,
    CacheAsValue,
    Capabilities,
    Decode,
    Family,
    Feature,
    LogicalRules,
    PathRules,
    Precision,
    PrecisionChange,
    Qwix,
)

from .flaxlm import LinenLm, LmConfig, NnxLm
from .functional import LinenFn, NnxFn, linen_cache, nnx_cache
from .models import RULES, LinenToy, NnxToy, ToyConfig
from .moe import AUX_LOSS, LinenMoe, MoeConfig, NnxMoe

SIZES = {
    "small": ToyConfig(vocab=64, width=32, hidden=64, depth=2, length=16),
    "large": ToyConfig(vocab=32000, width=4096, hidden=16384, depth=4, length=2048),
}


class ToyMinimal(Family):
    """Only what the contract requires: one layout, nothing optional."""

    name = "toy-minimal"
    sizes = ("small", "large")
    unsupported: Mapping[str, str] = MappingProxyType(
        {
            "scan_layers": "its blocks are a Python list, never stacked",
            "decode": "it keeps no KV cache",
        }
    )

    def config(self, size: str, *, scan_layers: bool, dtype: Any = jnp.float32) -> ToyConfig:
        return dataclasses.replace(SIZES[size], stacked=scan_layers, dtype=dtype)

    def linen_module(self, config: ToyConfig) -> nn.Module:
        return LinenToy(config)

    def nnx_module(self, config: ToyConfig, rngs: nnx.Rngs) -> nnx.Module:
        return NnxToy(config, rngs)

    def batch(self, config: ToyConfig, batch_size: int, seed: int = 0) -> Batch:
        """Tokens over the whole vocabulary, token 0 included; row i ends in i pads."""
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, config.vocab, (batch_size, config.length + 1), dtype=np.int32)
        length = np.arange(config.length)
        real = length[None, :] < config.length - np.arange(batch_size)[:, None] % config.length
        return Batch(
            tokens=jnp.asarray(tokens[:, :-1]),
            positions=jnp.asarray(np.broadcast_to(length, real.shape), jnp.int32),
            segment_ids=jnp.asarray(real, jnp.int32),
            targets=jnp.asarray(tokens[:, 1:]),
        )

    def path_rules(self, config: ToyConfig) -> PathRules:
        return () if config.stacked else ((r"^block_(\d+)/", r"blocks/\1/"),)

    def logical_axis_rules(self) -> LogicalRules:
        return RULES


class ToyFull(ToyMinimal):
    """Every optional hook: both layouts, remat and dropout variants, decode, Qwix QAT."""

    name = "toy-full"
    unsupported: Mapping[str, str] = MappingProxyType({})
    capabilities = Capabilities(
        scan_layers=(True, False),
        remat=True,
        dropout=True,
        decode=True,
        # ptq_int8 on the scanned layout fails inside qwix 0.1.8 (flax_util.update_sharding:
        # "shape=(32, 64) spec=('layers', 'embed', 'mlp')"): QAT only, until it is localised.
        quantization=frozenset({"qat_int8"}),
    )
    train_rngs = ("dropout",)

    def train_kwargs(self, config: ToyConfig) -> Mapping[str, Any]:
        return {"train": True}

    def variant(self, config: ToyConfig, *, remat: bool = False, dropout: float = 0.0) -> ToyConfig:
        return dataclasses.replace(config, checkpointed=remat, dropout=dropout)

    def layer_stack_rules(self, config: ToyConfig) -> PathRules:
        return ((r"^block_(?P<layer>\d+)/", "blocks/"),)


class ToyLm(Family):
    """Written as Flax's examples are: decoding by config, logits of the current token.

    ``decode_config`` decodes one token per call, and the model shifts its inputs, so
    its logits predict the current token.
    """

    name = "toy-lm"
    capabilities = Capabilities(decode=True, decode_style="token")
    logits_predict = "current"
    unsupported: Mapping[str, str] = MappingProxyType(
        {"scan_layers": "its blocks are a Python list, never stacked"}
    )

    def config(self, size: str, *, scan_layers: bool, dtype: Any = jnp.float32) -> LmConfig:
        del size, scan_layers
        return LmConfig(vocab=64, width=32, depth=2, length=32, dtype=dtype)

    def decode_config(self, config: LmConfig) -> LmConfig:
        return dataclasses.replace(config, decode=True)

    def linen_module(self, config: LmConfig) -> nn.Module:
        return LinenLm(config)

    def nnx_module(self, config: LmConfig, rngs: nnx.Rngs) -> nnx.Module:
        return NnxLm(config, rngs)

    def batch(self, config: LmConfig, batch_size: int, seed: int = 0) -> Batch:
        """Tokens from 1 (0 is the model's start token); row i ends in i pads.

        The targets are the tokens themselves: the logits predict the current token.
        """
        rng = np.random.default_rng(seed)
        tokens = rng.integers(1, config.vocab, (batch_size, config.length), dtype=np.int32)
        length = np.arange(config.length)
        real = length[None, :] < config.length - np.arange(batch_size)[:, None] % config.length
        tokens = np.where(real, tokens, 0)
        return Batch(
            tokens=jnp.asarray(tokens),
            positions=jnp.asarray(np.broadcast_to(length, real.shape), jnp.int32),
            segment_ids=jnp.asarray(real, jnp.int32),
            targets=jnp.asarray(tokens),
        )

    def path_rules(self, config: LmConfig) -> PathRules:
        return ((r"^block_(\d+)/", r"blocks/\1/"), (r"^norm_(\d+)/", r"norms/\1/"))

    def logical_axis_rules(self) -> LogicalRules:
        return RULES


class ToyMoe(Family):
    """A mixture of experts: experts sharded on ``expert``, a sown load-balancing loss."""

    name = "toy-moe"
    capabilities = Capabilities(aux_losses=(AUX_LOSS,))
    unsupported: Mapping[str, str] = MappingProxyType(
        {
            "scan_layers": "its blocks are a Python list, never stacked",
            "decode": "it keeps no KV cache",
        }
    )

    def config(self, size: str, *, scan_layers: bool, dtype: Any = jnp.float32) -> MoeConfig:
        del size, scan_layers
        return MoeConfig(vocab=64, width=32, hidden=64, experts=4, depth=2, length=16, dtype=dtype)

    def features(self) -> Sequence[Feature]:
        """Flax's two LayerNorms round differently; the zoo accepts it."""
        norm = PrecisionChange(
            r"block_\d+/norm",
            ("sum of products",),
            "flax 0.12's nnx.LayerNorm rounds its input to the compute dtype before its "
            "statistics (promote_dtype); nn.LayerNorm computes them on the input as given",
        )
        return (Precision((norm,)),)

    def linen_module(self, config: MoeConfig) -> nn.Module:
        return LinenMoe(config)

    def nnx_module(self, config: MoeConfig, rngs: nnx.Rngs) -> nnx.Module:
        return NnxMoe(config, rngs)

    def batch(self, config: MoeConfig, batch_size: int, seed: int = 0) -> Batch:
        return ToyMinimal.batch(self, config, batch_size, seed)

    def path_rules(self, config: MoeConfig) -> PathRules:
        return ((r"^block_(\d+)/", r"blocks/\1/"),)

    def logical_axis_rules(self) -> LogicalRules:
        return (*RULES, ("expert", "data"))


class ToyFn(Family):
    """Its modules take their KV cache and return it as a value, keyed per backend.

    Decoding with a prefill (the ``mode`` keyword), and quantized by Qwix PTQ.
    """

    name = "toy-fn"
    unsupported: Mapping[str, str] = MappingProxyType(
        {"scan_layers": "its blocks are a Python list, never stacked"}
    )

    def features(self) -> Sequence[Feature]:
        cache = CacheAsValue(init=linen_cache, nnx_init=nnx_cache)
        return (Decode(cache=cache), Qwix(frozenset({"ptq_int8"})))

    def config(self, size: str, *, scan_layers: bool, dtype: Any = jnp.float32) -> ToyConfig:
        del size, scan_layers
        return dataclasses.replace(SIZES["small"], dtype=dtype)

    def linen_module(self, config: ToyConfig) -> nn.Module:
        return LinenFn(config)

    def nnx_module(self, config: ToyConfig, rngs: nnx.Rngs) -> nnx.Module:
        return NnxFn(config, rngs)

    def batch(self, config: ToyConfig, batch_size: int, seed: int = 0) -> Batch:
        return ToyMinimal.batch(self, config, batch_size, seed)

    def path_rules(self, config: ToyConfig) -> PathRules:
        return ((r"^block_(\d+)/", r"blocks/\1/"),)

    def logical_axis_rules(self) -> LogicalRules:
        return RULES


class ToyFnToken(ToyFn):
    """:class:`ToyFn` decoding token by token: its cache is a value in that style too.

    A call given the cache continues from it, so the serving config is the config.
    """

    name = "toy-fn-token"

    def features(self) -> Sequence[Feature]:
        cache = CacheAsValue(init=linen_cache, nnx_init=nnx_cache)
        return (Decode(style="token", config=lambda config: config, cache=cache),)
