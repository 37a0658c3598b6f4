"""What both backends' trainers share: seams, optimizer, and the jitted step.

A backend's trainer (:mod:`conformance.runtime.training`) subclasses :class:`TrainerBase`
and implements its unjitted ``step`` and ``aux_gradient``; the jitting, with the train
state's shardings in and out, is here, as is the step traced with every module call
routed through a caller's hook (:meth:`TrainerBase.step_fn_around`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from conformance.contract import Backend, Family, VocabTiling, aux_losses, required
from conformance.core.seams import seam
from conformance.runtime.calls import Around
from conformance.runtime.objective import accumulate, make_optimizer, masked_token_loss
from conformance.runtime.train_state import replicated


def _tiled(family: Family, config: Any, micro_batches: int, vocab_tiles: int) -> Any:
    """``config`` with the family's vocab tiling, or unchanged for one tile."""
    if vocab_tiles == 1:
        return config
    if micro_batches != 1:
        raise ValueError("a vocab-tiled step takes the whole batch (one micro-batch)")
    return required(family, VocabTiling).config(config, vocab_tiles)


def _jitted(step: Callable[..., Any], shardings: Any) -> Any:
    """``step`` jitted with the state's ``shardings`` in and out (the batch's its own)."""
    in_sh = out_sh = micro = None
    if shardings is not None:
        in_sh, out_sh = (shardings, None), (shardings, None)
        micro = replicated(jax.tree.leaves(shardings)[0].mesh)
    bound = functools.partial(step, micro_sharding=micro)
    return jax.jit(bound, in_shardings=in_sh, out_shardings=out_sh)


class TrainerBase:
    """What both backends' trainers share: seams, optimizer, the jitted step and gradient.

    A backend's trainer builds its runner and train state and implements ``step`` and
    ``aux_gradient`` (unjitted); both are jitted here, once per trainer (and per state
    sharding). The loss and accumulation are the seams ``<backend>_loss`` and
    ``<backend>_accumulate`` (:mod:`conformance.core.seams`), read when it is built.
    """

    backend: Backend

    def __init__(self, family: Family, config: Any, micro_batches: int, vocab_tiles: int) -> None:
        self.config = _tiled(family, config, micro_batches, vocab_tiles)
        self.train_kwargs = dict(family.train_kwargs(self.config))
        self.tiled = vocab_tiles > 1
        self.micro_batches = micro_batches
        self.tx = make_optimizer()
        self.predicts = family.logits_predict
        self.aux_names = aux_losses(family)
        default_loss = functools.partial(masked_token_loss, predicts=self.predicts)
        self.loss = seam(f"{self.backend}_loss", default_loss)
        self.accumulate = seam(f"{self.backend}_accumulate", accumulate)
        self._steps: dict[Any, Any] = {}

    def step_fn(self, shardings: Any = None) -> Any:
        """The jitted ``(state, batch) -> (state, metrics)``, cached per state sharding."""
        leaves = None if shardings is None else tuple(jax.tree.leaves(shardings))
        if leaves not in self._steps:
            self._steps[leaves] = _jitted(self.step, shardings)
        return self._steps[leaves]

    @functools.cached_property
    def aux_gradient_fn(self) -> Any:
        """The jitted :meth:`aux_gradient`, traced once per trainer."""
        return jax.jit(self.aux_gradient)

    def step_fn_around(self, around: Around, shardings: Any) -> Any:
        """:meth:`step_fn` for ``shardings``, every module call it traces through ``around``.

        Jitted anew, never cached: trace it once per ``around``.
        """
        return _jitted(self._step_around(around), shardings)

    def _step_around(self, around: Around) -> Callable[..., Any]:
        """:meth:`step`, unjitted, with every module method call it traces through ``around``."""
        raise NotImplementedError
