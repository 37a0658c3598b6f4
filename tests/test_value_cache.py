"""Caches as values: a family whose modules take their KV cache and return it.

The prefill style runs in the zoo's whole-suite run (``toy-fn``); the token-by-token
style runs here, with the declaration's own errors and an adapter that breaks the
calling convention.
"""

from typing import Any

import pytest

from conformance.contract import CacheAsValue, Capabilities, Decode, declared, problems, supports
from conformance.core.failure import CheckFailure
from conformance.core.scope import Scope
from conformance.core.sharding import parse_mesh
from tests.contract.toyzoo.families import ToyFn, ToyFnToken, ToyLm, ToyMinimal
from tests.contract.toyzoo.functional import LinenFn, linen_cache
from tests.suite_run import run_check

MESH = parse_mesh("data=2,fsdp=2,tensor=2")


@pytest.mark.parametrize("check", ["decode_cache", "decode", "decode_consistency"])
def test_a_value_cache_decodes_token_by_token(check, tmp_path):
    with Scope():
        run_check(check, ToyFnToken(), tmp_path, MESH)


def _declaring(*features: Any, **attributes: Any) -> ToyFn:
    """:class:`ToyFn` declaring ``features`` instead of its own, with ``attributes``."""
    kind = type("Declaring", (ToyFn,), {"features": lambda self: features, **attributes})
    return kind()


CACHE = CacheAsValue(init=linen_cache)


def test_a_decode_feature_is_checked_at_load():
    assert problems(_declaring(Decode(cache=CACHE))) == []
    cases = {
        (Decode(cache=CACHE), Decode()): [
            "family 'toy-fn' lists Decode twice in features(); give one"
        ],
        ("decode",): [
            "family 'toy-fn' lists 'decode' in features(), which is no Feature "
            "(Decode, Remat, Aqt, ...)"
        ],
        (Decode(style="tokens"),): [
            "family 'toy-fn' declares Decode(style='tokens'); known styles: prefill, token"
        ],
        (Decode(style="token"),): [
            "family 'toy-fn' declares Decode(style='token') without config=, the config "
            "whose modules decode one token per call (config(config) -> config)"
        ],
        (Decode(config=lambda c: c),): [
            "family 'toy-fn' declares Decode(config=...) with style='prefill': declare "
            "style='token' to decode token by token, or drop config"
        ],
        (Decode(cache=("init", None)),): [  # type: ignore[arg-type]
            "family 'toy-fn' declares Decode(cache=('init', None)); give a CacheAsValue (a "
            "cache passed as a value) or None (held in the model)"
        ],
        (Decode(cache=CacheAsValue(init=None, keyword="kv cache")),): [  # type: ignore[arg-type]
            "family 'toy-fn' declares CacheAsValue(init=None), which is not callable as "
            "init(config, batch_size)",
            "family 'toy-fn' declares CacheAsValue(nnx_init=None), which is not callable as "
            "nnx_init(config, batch_size)",
            "family 'toy-fn' declares CacheAsValue(keyword='kv cache'), which is not a "
            "keyword argument's name",
        ],
    }
    for features, expected in cases.items():
        assert problems(_declaring(*features)) == expected, features
    twice = _declaring(Decode(), capabilities=Capabilities(decode=True))
    assert problems(twice) == [
        "family 'toy-fn' declares decode twice, as Decode(...) in features() and as "
        "Capabilities(decode=True): keep the Decode feature"
    ]


def test_both_editions_read_the_same():
    first = ToyLm()
    assert supports(first, "decode")
    assert not first.features()
    decode = declared(first, Decode)
    assert decode is not None
    assert (decode.style, decode.cache) == ("token", None)
    config = first.config("small", scan_layers=False)
    assert decode.config is not None
    assert decode.config(config) == first.decode_config(config)
    second = ToyFnToken()
    assert supports(second, "decode")
    assert not second.capabilities.decode
    decode = declared(second, Decode)
    assert decode is not None
    assert (decode.style, decode.cache) == ("token", second.features()[0].cache)
    assert declared(ToyMinimal(), Decode) is None
    assert not supports(ToyMinimal(), "decode")


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
