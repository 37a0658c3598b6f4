"""Caches as values: a family whose modules take their KV cache and return it.

The prefill style runs in the zoo's whole-suite run (``toy-fn``); the token-by-token
style runs here, with the declaration's own errors and an adapter that breaks the
calling convention.
"""

from typing import Any

import pytest

from conformance.contract import CacheAsValue, Capabilities, problems
from conformance.core.failure import CheckFailure
from conformance.core.scope import Scope
from conformance.core.sharding import parse_mesh
from tests.contract.toyzoo.families import ToyFn, ToyFnToken
from tests.contract.toyzoo.functional import LinenFn
from tests.suite_run import run_check

MESH = parse_mesh("data=2,fsdp=2,tensor=2")


@pytest.mark.parametrize("check", ["decode_cache", "decode", "decode_consistency"])
def test_a_value_cache_decodes_token_by_token(check, tmp_path):
    with Scope():
        run_check(check, ToyFnToken(), tmp_path, MESH)


class NoDecode(ToyFn):
    capabilities = Capabilities()


class NotAFeature(ToyFn):
    cache: Any = ("init", None)


class Broken(ToyFn):
    cache = CacheAsValue(init=None, keyword="kv cache")  # type: ignore[arg-type]


def test_a_value_cache_declaration_is_checked_at_load():
    assert problems(NoDecode()) == [
        "family 'toy-fn' declares cache=CacheAsValue(...) but not Capabilities(decode=True)"
    ]
    assert problems(NotAFeature()) == [
        "family 'toy-fn' declares cache=('init', None); give a CacheAsValue (a cache passed "
        "as a value) or None (held in the model)"
    ]
    assert problems(Broken()) == [
        "family 'toy-fn' declares CacheAsValue(init=None), which is not callable as "
        "init(config, batch_size)",
        "family 'toy-fn' declares CacheAsValue(nnx_init=None), which is not callable as "
        "nnx_init(config, batch_size)",
        "family 'toy-fn' declares CacheAsValue(keyword='kv cache'), which is not a keyword "
        "argument's name",
    ]


class LogitsOnly(LinenFn):
    """A Linen side that takes the cache but returns the logits alone."""

    def __call__(self, tokens, positions, segment_ids, mode="forward", cache=None):
        out = super().__call__(tokens, positions, segment_ids, mode, cache)
        return out[0] if cache is not None else out


class ReturnsLogitsOnly(ToyFn):
    def linen_module(self, config):
        return LogitsOnly(config)


def test_a_model_that_breaks_the_convention_is_named(tmp_path):
    with Scope(), pytest.raises(CheckFailure) as caught:
        run_check("decode", ReturnsLogitsOnly(), tmp_path, MESH)
    report = str(caught.value)
    assert (
        "toy-fn decode: Linen raised DecodeError while decoding (LinenValueDecoder.run)" in report
    )
    assert "the model returned an array, not (logits, cache) (CacheAsValue)" in report
