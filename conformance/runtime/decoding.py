"""Serving on both backends: an empty KV cache, a padded prompt's prefill, greedy decode.

A cache is held in the model (Linen's ``cache`` collection, ``nnx.Cache`` variables:
:class:`LinenDecoder`, :class:`NnxDecoder`) or passed in and out of each call as a value
(``Decode(cache=CacheAsValue(...))``: :class:`ValueDecoder`).

Every decoder speaks flat ``{path: array}`` dicts for parameters and cache, as the
runners in :mod:`conformance.runtime.backends` do, and jits each mode once per cache
sharding. :func:`conformance.runtime.generation.generate` drives any of them through the
same loop,
so a difference between the backends can only come from the models.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding

from conformance.contract import Batch, CacheAsValue, Decode, Family, declared
from conformance.core.scope import scoped
from conformance.core.sharding import Logical, linen_logical, nnx_logical
from conformance.core.trees import (
    Flat,
    LeafSpec,
    flatten,
    flatten_state,
    join_path,
    refill,
    specs,
    unflatten,
)
from conformance.runtime.backends import (
    Runner,
    linen_runner,
    mesh_of,
    model_inputs,
    nnx_runner,
)

CacheShardings = Mapping[str, NamedSharding]


class DecodeError(RuntimeError):
    """A family cannot serve: no cache, or a prompt that does not fit."""


def _jitted(
    cache: dict[Any, Any], fn: Callable[..., Any], shardings: CacheShardings | None, out: Any
) -> Any:
    """``jax.jit(fn)`` once per cache sharding, with out_shardings ``out`` when sharded.

    ``out`` is ``shardings`` for a program returning the flat cache, ``(None,
    shardings)`` for one returning logits and the flat cache.
    """
    key = tuple(sorted(shardings.items())) if shardings else None
    if key not in cache:
        cache[key] = jax.jit(fn, out_shardings=out if shardings else None)
    return cache[key]


def decoding(family: Family) -> Decode:
    """How ``family`` decodes (its :class:`~conformance.contract.Decode`, in either edition)."""
    found = declared(family, Decode)
    if found is None:
        raise DecodeError(f"{family.name} does not decode (it declares no Decode feature)")
    return found


def by_token(family: Family) -> bool:
    """Whether ``family`` decodes token by token (``Decode(style="token")``)."""
    return decoding(family).style == "token"


def _serving(family: Family, config: Any) -> Any:
    """The config ``family`` serves ``config`` with.

    Its :attr:`Decode.config <conformance.contract.Decode.config>` of ``config`` when it
    decodes token by token, else ``config`` itself (whose modules take a ``mode`` keyword).
    """
    decode = decoding(family)
    token = decode.style == "token" and decode.config is not None
    return decode.config(config) if token else config


def _mode(family: Family, mode: str) -> dict[str, str]:
    """The call keywords selecting ``mode``: ``{"mode": mode}``.

    None for token-by-token decoding, which the serving config selects.
    """
    return {} if by_token(family) else {"mode": mode}


class Decoder(abc.ABC):
    """A family's model served through its KV cache, for ``rows`` prompts.

    What every decoder shares: the cache is a flat dict, with :attr:`specs` and
    :attr:`logical` by path, and each call is one jitted function of its arguments. A
    subclass gives the programs (:meth:`_init_impl`, :meth:`_call`), of flat caches in
    and out unless it says otherwise.
    """

    family: Family
    rows: int
    specs: dict[str, LeafSpec]
    """Every cache leaf's shape and dtype, by path."""
    logical: dict[str, Logical]
    """Every cache leaf's logical axis names, by path."""
    _fns: dict[str, dict[Any, Any]]
    """The jitted programs by mode (``init``, ``prefill``, ``decode``) and cache sharding."""

    @abc.abstractmethod
    def _init_impl(self) -> Flat:
        """In a traced program: the empty cache, flat."""

    def init_cache(self, shardings: CacheShardings | None = None) -> Flat:
        """An empty cache for ``rows`` prompts, created directly with ``shardings``."""
        return _jitted(self._fns["init"], self._init_impl, shardings, shardings)()

    def run(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None = None,
    ) -> tuple[jax.Array, Flat]:
        """Logits and the updated cache of one ``prefill`` or ``decode`` call."""
        fn, args = self._call(mode, params, cache, batch, shardings)
        return fn(*args)

    @abc.abstractmethod
    def _call(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None,
        abstract: bool = False,
    ) -> tuple[Any, tuple[Any, ...]]:
        """The jitted function of a ``mode`` call and the arguments it takes.

        ``abstract``: what the side adds to the arguments is abstract too (for lowering).
        """

    def lowered(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None = None,
    ) -> jax.stages.Lowered:
        """The program :meth:`run` runs for these arguments, lowered, not compiled.

        Every argument may be ``jax.ShapeDtypeStruct`` leaves with shardings: nothing is
        computed, so the mesh may be one this host cannot run on.
        """
        fn, args = self._call(mode, params, cache, batch, shardings, abstract=True)
        return fn.lower(*args)


class LinenDecoder(Decoder):
    """A Linen family served through its ``cache`` collection, for ``rows`` prompts."""

    def __init__(self, family: Family, config: Any, rows: int) -> None:
        self.family, self.config, self.rows = family, config, rows
        self.module = linen_runner(family, _serving(family, config)).module
        example = model_inputs(family.batch(config, rows))
        init = functools.partial(self.module.init, **_mode(family, "prefill"))
        boxed = jax.eval_shape(init, jax.random.key(0), *example).get("cache")
        if not boxed:
            how = "decode_config" if by_token(family) else "mode='prefill'"
            raise DecodeError(f"{family.name}: Linen init in {how} created no 'cache' collection")
        self.logical: dict[str, Logical] = linen_logical(boxed)
        self.specs: dict[str, LeafSpec] = specs(flatten(nn.meta.unbox(boxed)))
        self._fns: dict[str, dict[Any, Any]] = {"init": {}, "prefill": {}, "decode": {}}

    def _init_impl(self) -> Flat:
        batch = self.family.batch(self.config, self.rows)
        variables = self.module.init(
            jax.random.key(0), *model_inputs(batch), **_mode(self.family, "prefill")
        )
        return flatten(nn.meta.unbox(variables["cache"]))

    def _serve(self, params: Any, cache: Any, batch: Batch, *, mode: str) -> Any:
        logits, mutated = self.module.apply(
            {"params": params, "cache": cache},
            *model_inputs(batch),
            **_mode(self.family, mode),
            mutable=["cache"],
        )
        return logits, flatten(nn.meta.unbox(mutated["cache"]))

    def _call(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None,
        abstract: bool = False,
    ) -> tuple[Any, tuple[Any, ...]]:
        serve = functools.partial(self._serve, mode=mode)
        fn = _jitted(self._fns[mode], serve, shardings, (None, shardings))
        return fn, (unflatten(params), unflatten(cache), batch)


class NnxDecoder(Decoder):
    """An NNX family served through ``nnx.Cache`` variables, for ``rows`` prompts.

    The model's ``init_cache(rows)`` creates the cache; non-parameter, non-cache state
    (RNG streams) comes from :meth:`conformance.runtime.backends.NnxRunner.rest`.
    """

    def __init__(self, family: Family, config: Any, rows: int) -> None:
        self.family, self.config, self.rows = family, config, rows
        self.runner = nnx_runner(family, _serving(family, config))
        if not callable(getattr(self.runner.abstract, "init_cache", None)):
            raise DecodeError(f"{family.name}: the NNX module has no init_cache(batch_size)")
        abstract = nnx.eval_shape(lambda: self._with_cache(0))
        self.graphdef, _, cache, _ = nnx.split(abstract, nnx.Param, nnx.Cache, ...)
        if not flatten_state(cache):
            raise DecodeError(f"{family.name}: NNX init_cache({rows}) created no nnx.Cache")
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(cache)}
        self._abstract_vars = flatten_state(cache)
        self.logical: dict[str, Logical] = nnx_logical(cache)
        self.specs: dict[str, LeafSpec] = specs(self._abstract_vars)
        self._fns: dict[str, dict[Any, Any]] = {"init": {}, "prefill": {}, "decode": {}}

    def _with_cache(self, seed: int) -> nnx.Module:
        model = self.runner.build(seed)
        with nnx.use_eager_sharding(False):
            model.init_cache(self.rows)
        return model

    def _state(self, cache: Mapping[str, Any]) -> nnx.State:
        return nnx.from_flat_state(
            [(self._keys[p], self._abstract_vars[p].replace(v)) for p, v in cache.items()]
        )

    def _init_impl(self) -> Flat:
        return _values(nnx.state(self._with_cache(0), nnx.Cache))

    def _serve(
        self, params: nnx.State, cache: nnx.State, rest: nnx.State, batch: Batch, *, mode: str
    ) -> Any:
        model = nnx.merge(self.graphdef, params, cache, rest)
        logits = model(*model_inputs(batch), **_mode(self.family, mode))
        return logits, _values(nnx.state(model, nnx.Cache))

    def _call(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None,
        abstract: bool = False,
    ) -> tuple[Any, tuple[Any, ...]]:
        serve = functools.partial(self._serve, mode=mode)
        fn = _jitted(self._fns[mode], serve, shardings, (None, shardings))
        rest = self.runner.context(mesh_of(params), abstract=abstract)
        return fn, (self.runner.pack(params), self._state(cache), rest, batch)


def _as_value(family: Family) -> CacheAsValue:
    """``family``'s :class:`~conformance.contract.CacheAsValue`; it must declare one."""
    cache = decoding(family).cache
    if cache is None:
        raise DecodeError(f"{family.name} holds its cache in the model (Decode(cache=None))")
    return cache


class ValueDecoder(Decoder):
    """A family served through a cache its modules take and return as a value.

    The family's :class:`~conformance.contract.CacheAsValue` creates the cache, and each
    call passes it to the model through :meth:`~conformance.runtime.backends.Runner.apply`
    (the model's output is ``(logits, cache)``), so this is written once for both
    backends: a subclass gives the backend's runner and ``init``.
    """

    def __init__(
        self, family: Family, config: Any, rows: int, runner: Runner, init: Callable[..., Any]
    ) -> None:
        """``config`` is the serving config (:func:`_serving`), ``runner``'s."""
        self.family, self.rows, self.runner, self.config = family, rows, runner, config
        self._init, self._keyword = init, _as_value(family).keyword
        boxed = jax.eval_shape(lambda: init(self.config, rows))
        self._abstract = nn.meta.unbox(boxed)
        self.specs = specs(flatten(self._abstract))
        if not self.specs:
            raise DecodeError(f"{family.name}: CacheAsValue.init(config, {rows}) made no arrays")
        self.logical = linen_logical(boxed)
        self._fns: dict[str, dict[Any, Any]] = {"init": {}, "prefill": {}, "decode": {}}

    def _init_impl(self) -> Flat:
        return flatten(nn.meta.unbox(self._init(self.config, self.rows)))

    def _serve(self, params: Any, context: Any, cache: Flat, batch: Batch, *, mode: str) -> Any:
        call = {**_mode(self.family, mode), self._keyword: refill(self._abstract, cache)}
        out, _ = self.runner.apply(params, context, batch, call=call)
        if not (isinstance(out, tuple) and len(out) == 2):
            what = "an array" if isinstance(out, jax.Array) else type(out).__name__
            raise DecodeError(
                f"{self.family.name}: called with {self._keyword}=<cache>, the model returned "
                f"{what}, not (logits, cache) (CacheAsValue)"
            )
        logits, new_cache = out
        flat = flatten(nn.meta.unbox(new_cache))
        if set(flat) != set(cache):
            changed = sorted(set(flat) ^ set(cache))
            raise DecodeError(
                f"{self.family.name}: the model returned a cache with other leaves than it "
                f"was given ({len(changed)} differ, e.g. {changed[0]!r})"
            )
        return logits, flat

    def _call(
        self,
        mode: str,
        params: Flat,
        cache: Flat,
        batch: Batch,
        shardings: CacheShardings | None,
        abstract: bool = False,
    ) -> tuple[Any, tuple[Any, ...]]:
        serve = functools.partial(self._serve, mode=mode)
        fn = _jitted(self._fns[mode], serve, shardings, (None, shardings))
        context = self.runner.context(mesh_of(params), abstract=abstract)
        return fn, (self.runner.pack(params), context, cache, batch)


class LinenValueDecoder(ValueDecoder):
    """A Linen family's modules served with their cache passed as a value."""

    def __init__(self, family: Family, config: Any, rows: int) -> None:
        serving = _serving(family, config)
        runner = linen_runner(family, serving)
        super().__init__(family, serving, rows, runner, _as_value(family).init)


class NnxValueDecoder(ValueDecoder):
    """An NNX family's modules served with their cache passed as a value."""

    def __init__(self, family: Family, config: Any, rows: int) -> None:
        serving, feature = _serving(family, config), _as_value(family)
        runner = nnx_runner(family, serving)
        super().__init__(family, serving, rows, runner, feature.nnx_init or feature.init)


def _values(cache: nnx.State) -> Flat:
    """``{path: array}`` of a cache state.

    Plain values, not Variables: a layer may change a cache variable's metadata (MaxText's
    scanned layers drop its sharding names), which must not make the output mismatch
    the output shardings.
    """
    return {path: var.get_value() for path, var in flatten_state(cache).items()}


@scoped
def linen_decoder(family: Family, config: Any, rows: int) -> Decoder:
    """The Linen decoder for ``(family, config, rows)``, of the family's kind of cache."""
    if decoding(family).cache is not None:
        return LinenValueDecoder(family, config, rows)
    return LinenDecoder(family, config, rows)


@scoped
def nnx_decoder(family: Family, config: Any, rows: int) -> Decoder:
    """The NNX decoder for ``(family, config, rows)``, of the family's kind of cache."""
    if decoding(family).cache is not None:
        return NnxValueDecoder(family, config, rows)
    return NnxDecoder(family, config, rows)
