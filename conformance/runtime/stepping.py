"""A side's train state and its jitted step, advanced one batch at a time.

:class:`Training` is what every train-step comparison holds per side: the trainer, the
placed state and the compiled step. It returns each step's results keyed by canonical
paths, so two sides (or a side and a recording) compare leaf for leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import jax

from conformance.core.trees import Flat
from conformance.runtime.live import Side, Trainer
from conformance.runtime.train_state import flat_state
from conformance.runtime.transplant import transplant

StepResult = tuple[Flat, Any, Flat]
"""One step's ``(state, loss, grads)``, keyed by canonical paths."""


def params_of(state: Flat, params: Collection[str]) -> Flat:
    """The model parameters of a flat train state, keyed by their parameter paths.

    Only the paths in ``params`` (a runner's parameters): what the state's ``model``
    keeps beside them (FP8 values, persistent state) is left out.
    """
    model = {p.removeprefix("model/"): v for p, v in state.items() if p.startswith("model/")}
    return {p: v for p, v in model.items() if p in params}


@dataclasses.dataclass
class Training:
    """One side's trainer, its placed train state and jitted step on the case's mesh."""

    side: Side
    trainer: Trainer
    initial: Flat
    """The parameters the state started from (the side's own paths, on the devices)."""
    state: Any
    shardings: Any
    step: Any
    aux: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The auxiliary losses the last step added to its loss, by name (see
    :class:`~conformance.contract.AuxLosses`)."""

    @classmethod
    def start(
        cls, side: Side, params: Flat | None = None, micro_batches: int = 1, vocab_tiles: int = 1
    ) -> Training:
        """A fresh train state around ``params`` (own paths; default: init from seed 0).

        Raises :class:`~conformance.runtime.backends.TransplantError` if ``params`` do not
        fit the trainer's model (accumulating or tiling must not change the parameters).
        """
        trainer = side.trainer(micro_batches, vocab_tiles)
        case = side.case
        param_sh = case.shardings(trainer.runner.logical)
        if params is None:
            params = trainer.runner.init(0, param_sh)
        else:
            params = transplant(params, {}, trainer.runner.specs, param_sh)
        shardings = trainer.tree(case.shardings(trainer.logical))
        state = jax.device_put(trainer.initial_state(params), shardings)
        return cls(side, trainer, params, state, shardings, trainer.step_fn(shardings))

    def aux_gradient(self, batch: Any) -> Flat:
        """The gradient of the family's auxiliary losses alone at the current state.

        Keyed by canonical paths (see :class:`~conformance.contract.AuxLosses`).
        """
        grads = self.trainer.aux_gradient_fn(self.state, batch)
        return self.side.canonical(flat_state(grads))

    def params(self) -> Flat:
        """The current parameters, in the side's own paths."""
        return params_of(flat_state(self.state), self.trainer.runner.specs)

    def advance(self, batch: Any) -> StepResult:
        """One step (the state advances): ``(state, loss, grads)`` by canonical paths."""
        self.state, metrics = self.step(self.state, batch)
        self.aux = dict(metrics.get("aux", {}))
        return (
            self.side.canonical(flat_state(self.state)),
            metrics["loss"],
            self.side.canonical(flat_state(metrics["grads"])),
        )
