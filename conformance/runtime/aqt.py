"""AQT (aqtp) on both backends: freeze float kernels into int8 ones, and serve from them.

TRAIN mode needs nothing here: a family's ``aqt_config(config, "train")`` is an ordinary
config, run by the runners of :mod:`conformance.runtime.backends`. CONVERT runs float
parameters through the convert-mode model, whose forward writes every frozen kernel
(``qvalue`` int8 plus ``scale``) to the ``aqt`` collection (in NNX an ``aqt`` Variable,
through ``nnx.bridge``). SERVE runs the serve-mode model, whose parameters are the float
ones less the quantized kernels, from those frozen kernels.

Frozen kernels are flat ``{canonical path: array}`` dicts, like parameters:
``layers_0/mlp/wi/AqtDotGeneral_0/qrhs/frozen/qvalue`` in Linen, ``layers/0/...`` in NNX.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
from flax import linen as nn
from flax import nnx

from conformance.contract import Aqt, Batch, Family, required
from conformance.core.failure import KnownFailure
from conformance.core.scope import scoped
from conformance.core.sharding import Logical, linen_logical
from conformance.core.trees import Flat, LeafSpec, flatten, flatten_state, join_path, refill, specs
from conformance.runtime.backends import Runner, linen_runner, mesh_of, nnx_runner

COLLECTION = "aqt"
"""AQT's collection of frozen tensors (``AqtDotGeneral.quant_collection``'s default)."""


class AqtError(RuntimeError):
    """A family's AQT modes do not produce what convert and serve need."""


def frozen_variable_type() -> type[nnx.Variable[Any]]:
    """The NNX Variable type ``nnx.bridge`` gives the ``aqt`` collection."""
    return nnx.variable_type_from_name(COLLECTION, allow_register=True)


class AqtModel(abc.ABC):
    """A family's model in AQT convert and serve modes, written once over the runners.

    A backend's subclass says how it holds the frozen kernels: :meth:`pack` and
    :meth:`unpack` move them between flat dicts and what the runners' :meth:`apply
    <conformance.runtime.backends.Runner.apply>` sets and collects as ``aqt``.
    """

    runner: ClassVar[Callable[..., Runner]]
    """The backend's memoised runner constructor (``linen_runner``, ``nnx_runner``)."""

    def __init__(self, family: Family, config: Any) -> None:
        self.family = family
        quantized = required(family, Aqt).config
        self.convert_runner = type(self).runner(family, quantized(config, "convert"))
        self.serve_runner = type(self).runner(family, quantized(config, "serve"))
        self.logical: dict[str, Logical] = {}
        """Every frozen leaf's logical axis names, by flat path."""
        self.specs: dict[str, LeafSpec] = {}
        """Every frozen leaf's shape and dtype, by flat path."""
        self._convert = jax.jit(self._convert_impl)
        self._serve = jax.jit(self._serve_impl)

    @abc.abstractmethod
    def pack(self, frozen: Flat) -> Any:
        """The backend's ``aqt`` collection holding the flat ``frozen`` kernels."""

    @abc.abstractmethod
    def unpack(self, collected: Any) -> Flat:
        """The flat frozen kernels of the ``aqt`` collection a convert forward wrote."""

    def _convert_impl(self, params: Any, context: Any, batch: Batch) -> tuple[jax.Array, Any]:
        return self.convert_runner.apply(params, context, batch, collect=COLLECTION)

    def convert(self, params: Flat, batch: Batch) -> tuple[jax.Array, Flat]:
        """The convert-mode logits for ``batch`` and the frozen kernels made from ``params``."""
        runner = self.convert_runner
        logits, frozen = self._convert(runner.pack(params), runner.context(mesh_of(params)), batch)
        return logits, self.unpack(frozen)

    def _serve_impl(self, params: Any, context: Any, frozen: Any, batch: Batch) -> jax.Array:
        return self.serve_runner.apply(params, context, batch, held={COLLECTION: frozen})[0]

    def serve(self, params: Flat, frozen: Flat, batch: Batch) -> jax.Array:
        """Serve-mode logits from the kernel-less ``params`` and the ``frozen`` kernels."""
        runner = self.serve_runner
        context = runner.context(mesh_of(params))
        return self._serve(runner.pack(params), context, self.pack(frozen), batch)


class LinenAqt(AqtModel):
    """A family's Linen module in AQT modes: the frozen kernels are its ``aqt`` collection."""

    runner = staticmethod(linen_runner)

    def __init__(self, family: Family, config: Any) -> None:
        super().__init__(family, config)
        boxed = self.serve_runner.abstract_variables
        if not boxed.get(COLLECTION):
            raise AqtError(
                f"{family.name}: Linen init in AQT serve mode created no {COLLECTION!r} collection"
            )
        self.logical = linen_logical(boxed[COLLECTION])
        self._abstract = nn.meta.unbox(boxed[COLLECTION])
        self.specs = specs(flatten(self._abstract))

    def pack(self, frozen: Flat) -> Any:
        """The ``aqt`` collection's tree holding ``frozen``."""
        return refill(self._abstract, frozen)

    def unpack(self, collected: Any) -> Flat:
        """The flat dict of the ``aqt`` collection, unboxed."""
        return flatten(nn.meta.unbox(collected))


def _frozen_flat(variables: Mapping[str, nnx.Variable[Any]]) -> Flat:
    """Frozen leaves keyed ``<variable path>/<leaf path in its QTensor>``, unboxed."""
    return {
        f"{path}/{inner}": leaf
        for path, var in variables.items()
        for inner, leaf in flatten(nn.meta.unbox(var.get_value())).items()
    }


class NnxAqt(AqtModel):
    """A family's NNX module in AQT modes.

    The frozen kernels are ``aqt`` Variables holding AQT ``QTensor`` values, whose leaves
    carry the logical names AQT's axis-metadata wrapper gave them.
    """

    runner = staticmethod(nnx_runner)

    def __init__(self, family: Family, config: Any) -> None:
        super().__init__(family, config)
        frozen = nnx.state(self.serve_runner.abstract, frozen_variable_type())
        self._vars = flatten_state(frozen)
        if not self._vars:
            raise AqtError(
                f"{family.name}: the NNX module in AQT serve mode has no {COLLECTION!r} Variables"
            )
        self._keys = {join_path(keys): keys for keys, _ in nnx.to_flat_state(frozen)}
        self.logical = {
            f"{path}/{inner}": names
            for path, var in self._vars.items()
            for inner, names in linen_logical(var.get_value()).items()
        }
        self.specs = specs(_frozen_flat(self._vars))

    def pack(self, frozen: Flat) -> nnx.State:
        """An ``nnx.State`` of ``aqt`` Variables holding the flat ``frozen`` kernels."""
        return nnx.from_flat_state(
            [
                (
                    self._keys[path],
                    var.replace(refill(nn.meta.unbox(var.get_value()), frozen, f"{path}/")),
                )
                for path, var in self._vars.items()
            ]
        )

    def unpack(self, collected: nnx.State) -> Flat:
        """The flat frozen leaves of an ``nnx.State`` of ``aqt`` Variables."""
        return _frozen_flat(flatten_state(collected))


_UNNAMED = r"CheckFailure: .* aqt_layout: frozen leaves whose sharding cannot be resolved"
"""The words of scanned NNX frozen kernels that keep their per-layer logical names."""


def known_failure(check: str, scan_layers: bool) -> KnownFailure | None:
    """Why ``check`` cannot pass on this layer layout with the pinned libraries, if so."""
    if check == "aqt_layout" and scan_layers:
        return KnownFailure(
            "flax 0.12.12 + aqtp 0.9.0: nnx.vmap's transform_metadata adds the 'layers' axis "
            "to Variable metadata only, but AQT keeps each frozen tensor's logical names "
            "inside the bridged 'aqt' Variable's QTensor value, so scanned NNX frozen kernels "
            "keep per-layer names (3 names for the 4-dim attn/out qvalue) and cannot be "
            "sharded; Linen's nn.scan adds 'layers' to them",
            _UNNAMED,
        )
    return None


@scoped
def linen_aqt(family: Family, config: Any) -> LinenAqt:
    """The :class:`LinenAqt` for ``(family, config)``."""
    return LinenAqt(family, config)


@scoped
def nnx_aqt(family: Family, config: Any) -> NnxAqt:
    """The :class:`NnxAqt` for ``(family, config)``."""
    return NnxAqt(family, config)
