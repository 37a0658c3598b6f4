"""Faults in serving: the KV cache and the decode loop."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from conformance.runtime.generation import decode_positions
from conformance_models import nnx_layers
from tests.contract.toyzoo import flaxlm, functional
from tests.contract.toyzoo.families import ToyFn, ToyFnToken, ToyLm
from tests.faults.fault import Fault, Gpt3, Llama

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


def _float8_keys_in_bfloat16(self, k, v, segment_ids, mode):
    """NNX ``KVCache`` that serves keys rounded to float8 whenever it computes in bfloat16."""
    if mode != "forward" and k.dtype == jnp.bfloat16:
        k = k.astype(jnp.float8_e4m3fn).astype(k.dtype)
    return _serve_call(self, k, v, segment_ids, mode)


def _bfloat16_cache(self, batch_size, stacked=None):
    """NNX ``KVCache.init`` that stores keys in bfloat16 under a float32 config."""
    _init_cache(self, batch_size, stacked)
    self.key = self.key.replace(self.key[...].astype(jnp.bfloat16))


def positions_not_advanced(lengths, step):
    """The serving loop's positions, stuck at the first decode step's."""
    del step
    return decode_positions(lengths, 0)


_token_call = flaxlm.NnxAttention.__call__


def _token_index_stuck(self, x, segment_ids):
    """Token-by-token NNX attention that writes its cache but never advances its index."""
    out = _token_call(self, x, segment_ids)
    if self.config.decode:
        self.index[...] = self.index[...] - 1
    return out


_fn_block_call = functional.NnxFnBlock.__call__


def _value_cache_returned_unchanged(self, x, segment_ids, cache):
    """NNX block of the value-cache toy that serves from its cache but returns it as given."""
    out, _ = _fn_block_call(self, x, segment_ids, cache)
    return out, cache


class ToyLmPredictsNext(ToyLm):
    """The Flax-style toy declares next-token logits, but its model shifts its inputs."""

    logits_predict = "next"


_FLOAT32 = (
    Fault(
        ToyLm(),
        "decode_consistency",
        (
            "NNX prefill vs the full-sequence forward",
            "logits:",
        ),
        model_patch=(flaxlm.NnxAttention, "__call__", _token_index_stuck),
    ),
    Fault(
        ToyFn(),
        "decode",
        (
            "decode step 0 of 8",
            "the caches first differ after prefill",
            "blocks/0/count:",
            "verdict: a Linen/NNX divergence: it shows on one device too",
        ),
        model_patch=(functional.NnxFnBlock, "__call__", _value_cache_returned_unchanged),
    ),
    Fault(
        ToyFnToken(),
        "decode_consistency",
        ("NNX prefill vs the full-sequence forward", "logits:"),
        model_patch=(functional.NnxFnBlock, "__call__", _value_cache_returned_unchanged),
    ),
    Fault(
        ToyLmPredictsNext(),
        "decode_consistency",
        ("Linen prefill vs the full-sequence forward", "logits:"),
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
        model_patch=(nnx_layers.KVCache, "__call__", _never_writes_cache),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("NNX decode step 0 of 8", "vs the full forward", "logits:"),
        model_patch=(nnx_layers.KVCache, "__call__", _index_off_by_one),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("NNX prefill vs the full-sequence forward", "logits:"),
        model_patch=(nnx_layers.KVCache, "__call__", _prefill_without_causal_mask),
    ),
    Fault(
        Llama(),
        "decode_consistency",
        ("Linen decode step 1 of 8", "vs the full forward", "logits:"),
        seams={"decode_positions": positions_not_advanced},
    ),
    Fault(
        Gpt3(),
        "decode_cache",
        (
            "layers/0/attn/kv_cache/key: Linen float32[8, 32, 4, 16]",
            "!= NNX bfloat16[8, 32, 4, 16]",
        ),
        model_patch=(nnx_layers.KVCache, "init", _bfloat16_cache),
    ),
)


FAULTS = (
    *_FLOAT32,
    *(
        dataclasses.replace(
            fault,
            dtype=jnp.bfloat16,
            expect=(*fault.expect, "bfloat16 rounding:", "farther than rounding moves it"),
        )
        for fault in _FLOAT32
        if fault.check == "decode_consistency" and isinstance(fault.family, Llama)
    ),
    Fault(
        Llama(),
        "decode",
        (
            "decode step 0 of 8",
            "the caches first differ after prefill",
            "layers/0/attn/kv_cache/key:",
            "verdict: a Linen/NNX divergence (it shows on one device too)",
            "bfloat16 rounding: the float32 decodes disagree too",
            "a divergence the lower precision carries, not rounding",
        ),
        model_patch=(nnx_layers.KVCache, "__call__", _never_writes_cache),
        dtype=jnp.bfloat16,
    ),
    Fault(
        Llama(),
        "decode",
        (
            "prefill on mesh data2-fsdp2-tensor2",
            "bfloat16 rounding:",
            "farther than rounding moves it",
        ),
        model_patch=(nnx_layers.KVCache, "__call__", _float8_keys_in_bfloat16),
        dtype=jnp.bfloat16,
    ),
)
"""The serving faults; llama's ``decode_consistency`` ones again in bfloat16 compute, where
each must fail beyond rounding; in bfloat16 ``decode`` (NNX fed Linen's tokens), a cache NNX
never writes, which float32 shows too, and keys NNX rounds to float8 only in bfloat16."""
