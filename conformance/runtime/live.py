"""The live backends' sides: the Linen and the NNX implementation of a case, as values.

A :class:`Side` is one implementation of a :class:`~conformance.runtime.case.Case`'s
model on the case's mesh: it builds the model, places and initialises its parameters,
runs its forward, its train steps and its decoding. :class:`LinenSide` and
:class:`NnxSide` are the two live backends; the one-device reference of either is the
same side on the one-device case (:meth:`Side.reference`). A new kind of side (numbers
recorded from an earlier run) is a new subclass, never a branch in a check.

A side's trees are flat ``{path: array}`` dicts in its own paths and layouts.
:meth:`Side.canonical` takes them to the canonical paths and layouts (the NNX ones) that
comparisons are keyed by, through the side's :class:`~conformance.core.leafmap.LeafMap`,
and :meth:`Side.receive` takes another side's parameters into its own.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import numpy as np
from jax.sharding import NamedSharding

from conformance.contract import Backend, PathRules
from conformance.core.failure import fail
from conformance.core.leafmap import LeafMap, build
from conformance.core.sharding import Logical
from conformance.core.trees import Flat, PathMapError
from conformance.runtime.aqt import AqtModel, LinenAqt, NnxAqt, linen_aqt, nnx_aqt
from conformance.runtime.backends import LinenRunner, NnxRunner, Runner, linen_runner, nnx_runner
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.decoding import (
    Decoder,
    LinenDecoder,
    LinenValueDecoder,
    NnxDecoder,
    NnxValueDecoder,
    linen_decoder,
    nnx_decoder,
)
from conformance.runtime.generation import Generation, generate, prompt_batch
from conformance.runtime.training import LinenTrainer, NnxTrainer, linen_trainer, nnx_trainer
from conformance.runtime.transplant import TransplantError, transplant

Trainer = LinenTrainer | NnxTrainer


@dataclasses.dataclass(frozen=True)
class Side(abc.ABC):
    """One implementation of ``case``'s model, on ``case``'s mesh."""

    case: Case
    name: ClassVar[str]
    """How reports name the side (``Linen``, ``NNX``)."""
    backend: ClassVar[Backend]
    """The backend's id in checkpoints and test ids (``linen``, ``nnx``)."""
    key: ClassVar[str]
    """The side's own id in goldens and report tables (``linen``, ``nnx``, ``nnx-tree``):
    two modes of NNX share a backend, not a key."""
    lays_out_itself: ClassVar[bool] = False
    """Whether its programs lay values out as its own code says (jax's explicit axes),
    not as the compiler chooses: compared with a side that does not, its sums run in
    another order, and Adam turns a gradient's rounding noise into a full step."""
    parts: ClassVar[dict[type, str]]
    """The runtime objects the side builds, each with what it is (``model``, ``trainer``,
    ``decoder``, ``AQT model``): an exception raised in one of their methods is this
    side's (:mod:`conformance.checks.raised`)."""

    @property
    @abc.abstractmethod
    def runner(self) -> Runner:
        """The model: abstract layout, sharded init and jitted forward (in the case's mode)."""

    @abc.abstractmethod
    def trainer(self, micro_batches: int = 1, vocab_tiles: int = 1) -> Trainer:
        """The train state and jitted step, accumulating or tiling as asked."""

    @abc.abstractmethod
    def decoder(self, rows: int) -> Decoder:
        """The model served through its KV cache, for ``rows`` prompts."""

    @abc.abstractmethod
    def aqt(self) -> AqtModel:
        """The model in AQT convert and serve modes."""

    @abc.abstractmethod
    def leaf_map(self) -> LeafMap:
        """How each own parameter moves to its canonical path and layout, one-to-one."""

    def path_rules(self) -> PathRules:
        """The rules taking its parameter paths to canonical ones (none: they are)."""
        return ()

    def reference(self) -> Side:
        """The same side on the one-device counterpart of the case's mesh."""
        return self.on(self.case.on_one_device())

    def on(self, case: Case) -> Side:
        """The same kind of side for another case."""
        return dataclasses.replace(self, case=case)

    def unquantized(self) -> Side:
        """The same side of the float case (the case without its quantization mode)."""
        return self.on(self.case.quantized(None))

    def canonical(self, flat: Flat) -> Flat:
        """``flat`` in canonical paths and layouts: parameters, and state mirroring them.

        Any kind of leaf moves (arrays, shapes, logical names, kinds); see
        :meth:`LeafMap.canonical <conformance.core.leafmap.LeafMap.canonical>`.
        """
        try:
            return self.leaf_map().canonical(flat)
        except PathMapError as err:
            fail(f"{self.name}: {err}")

    def own(self, flat: Flat) -> Flat:
        """``flat``, in canonical paths and layouts, in this side's own."""
        try:
            return self.leaf_map().own(flat)
        except PathMapError as err:
            fail(f"{self.name}: {err}")

    def shardings(self, logical: dict[str, Logical] | None = None) -> dict[str, NamedSharding]:
        """Shardings on the case's devices for ``logical`` (default: the parameters')."""
        return self.case.shardings(self.runner.logical if logical is None else logical)

    def init(self, seed: int = 0) -> Flat:
        """Parameters initialised from ``seed``, created directly on the devices."""
        return self.runner.init(seed, self.shardings())

    def place(self, params: Flat) -> Flat:
        """``params`` (own paths) checked against the layout and placed on the devices."""
        try:
            return transplant(params, {}, self.runner.specs, self.shardings())
        except TransplantError as err:
            fail(f"{self.name}: {err}")

    def receive(self, params: Flat, source: Side) -> Flat:
        """``source``'s parameters in this side's paths, checked and placed on the devices.

        Every leaf must arrive, of the same shape and dtype (see
        :func:`~conformance.runtime.backends.transplant`); otherwise the check fails.
        """
        moved = self.own(source.canonical(params))
        try:
            return transplant(moved, {}, self.runner.specs, self.shardings())
        except TransplantError as err:
            fail(f"{source.name} -> {self.name}: {err}")

    def forward(self, params: Flat, batch: Any) -> tuple[Any, Any]:
        """Logits and sown per-block hidden states of ``batch`` from ``params``."""
        return self.runner.forward(params, batch)

    def generate(
        self, params: Flat, steps: int, rows: int = BATCH_SIZE, forced: np.ndarray | None = None
    ) -> Generation:
        """``params`` (own paths, on the devices) served greedily through the KV cache.

        ``rows`` prompts of different lengths from the family's batch
        (:func:`~conformance.runtime.generation.prompt_batch`), a prefill, then ``steps``
        decode steps, every call sharded on the case's mesh. ``forced`` tokens (another
        generation's) are fed instead of the greedy ones.
        """
        case = self.case
        prompt, lengths = prompt_batch(case.family, case.bound, rows, steps)
        decoder = self.decoder(rows)
        shardings = case.shardings(decoder.logical)
        return generate(decoder, params, prompt, lengths, steps, case.place, shardings, forced)


@dataclasses.dataclass(frozen=True)
class LinenSide(Side):
    """The Flax Linen implementation: ``Family.linen_module``."""

    name: ClassVar[str] = "Linen"
    backend: ClassVar[Backend] = Backend.LINEN
    key: ClassVar[str] = "linen"
    parts: ClassVar[dict[type, str]] = {
        LinenRunner: "model",
        LinenTrainer: "trainer",
        LinenDecoder: "decoder",
        LinenValueDecoder: "decoder",
        LinenAqt: "AQT model",
    }

    @property
    def runner(self) -> LinenRunner:
        """The Linen runner of the case's bound config and mode."""
        case = self.case
        return linen_runner(case.family, case.bound, case.quant)

    def trainer(self, micro_batches: int = 1, vocab_tiles: int = 1) -> LinenTrainer:
        """The Linen trainer of the case's bound config and mode."""
        case = self.case
        return linen_trainer(case.family, case.bound, micro_batches, case.quant, vocab_tiles)

    def decoder(self, rows: int) -> Decoder:
        """The Linen model served through its ``cache`` collection, or its cache as a value."""
        return linen_decoder(self.case.family, self.case.bound, rows)

    def aqt(self) -> LinenAqt:
        """The Linen model in AQT convert and serve modes."""
        return linen_aqt(self.case.family, self.case.bound)

    def path_rules(self) -> PathRules:
        """The family's path rules (:meth:`Family.path_rules`) of the case's bound config."""
        return self.case.family.path_rules(self.case.bound)

    def leaf_map(self) -> LeafMap:
        """The family's path rules bound to every Linen parameter.

        Values a train state keeps beside the parameters (the ``_overwrite_with_gradient``
        collection, persistent state) map by the same rules. A rule that does not fit its
        leaves, or two leaves mapped to one path, fail the check.
        """
        runner = self.runner
        shapes = {
            p: s.shape
            for leaves in (runner.specs, *runner.kept.values())
            for p, s in leaves.items()
        }
        try:
            return build(self.path_rules(), shapes)
        except PathMapError as err:
            fail(str(err))


@dataclasses.dataclass(frozen=True)
class NnxSide(Side):
    """The Flax NNX implementation: ``Family.nnx_module``; its paths are the canonical ones."""

    name: ClassVar[str] = "NNX"
    backend: ClassVar[Backend] = Backend.NNX
    key: ClassVar[str] = "nnx"
    parts: ClassVar[dict[type, str]] = {
        NnxRunner: "model",
        NnxTrainer: "trainer",
        NnxDecoder: "decoder",
        NnxValueDecoder: "decoder",
        NnxAqt: "AQT model",
    }

    @property
    def runner(self) -> NnxRunner:
        """The NNX runner of the case's bound config and mode."""
        case = self.case
        return nnx_runner(case.family, case.bound, case.quant)

    def trainer(self, micro_batches: int = 1, vocab_tiles: int = 1) -> NnxTrainer:
        """The NNX trainer of the case's bound config and mode."""
        case = self.case
        return nnx_trainer(case.family, case.bound, micro_batches, case.quant, vocab_tiles)

    def decoder(self, rows: int) -> Decoder:
        """The NNX model served through ``nnx.Cache`` variables, or its cache as a value."""
        return nnx_decoder(self.case.family, self.case.bound, rows)

    def aqt(self) -> NnxAqt:
        """The NNX model in AQT convert and serve modes."""
        return nnx_aqt(self.case.family, self.case.bound)

    def leaf_map(self) -> LeafMap:
        """Identity: NNX paths and layouts are canonical."""
        return build((), {path: spec.shape for path, spec in self.runner.specs.items()})

    def canonical(self, flat: Flat) -> Flat:
        """``flat`` unchanged: NNX paths are canonical."""
        return dict(flat)

    def own(self, flat: Flat) -> Flat:
        """``flat`` unchanged: NNX paths are canonical."""
        return dict(flat)


SIDES: dict[Backend, type[Side]] = {side.backend: side for side in (LinenSide, NnxSide)}
"""The live backends' sides, by backend id."""
