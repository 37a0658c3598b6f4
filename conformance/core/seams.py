"""Seams: the named steps of the runtime a test may replace, to plant a fault in the harness.

A planted fault proves a check can fail. Most faults live in a family (a model built
wrong on one side); the ones that break the harness's own machinery (how a train step
computes its loss, how a checkpoint is converted) replace one of these steps for the
duration of a :func:`planted` block, never a private name. The runtime reads each seam
where it takes the step, with its own implementation as the default
(:func:`seam`); every seam is listed in :data:`SEAMS` with what its replacement is
called with and must return.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

SEAMS: Mapping[str, str] = MappingProxyType(
    {
        "nnx_training_forward": "``(model, batch, train_kwargs) -> (logits, sown)``: how an "
        "NNX train step runs the model on a micro-batch, and what it sowed (captured, never "
        "stored; the auxiliary losses are read from it)",
        "nnx_loss": "``(logits, batch) -> (loss sum, target count)``: the NNX train step's "
        "loss (the harness's masked next-token cross entropy)",
        "nnx_accumulate": "``(grad_fn, batch, micro_batches, sharding) -> summed outputs``: "
        "how an NNX train step sums its micro-batches",
        "linen_loss": "``(logits, batch) -> (loss sum, target count)``: the Linen train "
        "step's loss (the harness's masked next-token cross entropy)",
        "linen_accumulate": "``(grad_fn, batch, micro_batches, sharding) -> summed "
        "outputs``: how a Linen train step sums its micro-batches",
        "nnx_train_state": "``(model, tx) -> nnx.Module``: the class of the NNX train state "
        "(model and optimizer)",
        "decode_positions": "``(lengths, step) -> positions [rows, 1]``: the positions the "
        "serving loop feeds decode step ``step`` at",
        "qwix_strip_transients": "``(model) -> None``: what is removed from an NNX model "
        "after Qwix's tracing forward (every ``nnx.Intermediate``)",
        "convert_paths": "``(state, to) -> state``: how checkpoint conversion moves a flat "
        "state to other paths and layouts (``to`` is a leaf map's ``canonical`` or ``own``)",
        "convert_restack": "``(flat, table, to_scan, axis) -> flat``: how checkpoint "
        "conversion stacks or splits layers",
        "convert_cast_counters": "``(state, target layout) -> state``: how checkpoint "
        "conversion casts step counters to the target's dtype",
        "checkpoint_restored": "``(restored flat tree) -> flat tree``: applied to every "
        "tree a checkpoint restore returns (identity)",
    }
)
"""Every seam, by name, with the signature of its replacement."""

_PLANTED: contextvars.ContextVar[Mapping[str, Callable[..., Any]]] = contextvars.ContextVar(
    "conformance_planted", default=MappingProxyType({})
)


def seam[F: Callable[..., Any]](name: str, default: F) -> F:
    """The step planted at seam ``name``, or ``default`` (the harness's own) if none is."""
    if name not in SEAMS:
        raise KeyError(f"no seam {name!r}; seams: {', '.join(SEAMS)}")
    return _PLANTED.get().get(name, default)


@contextlib.contextmanager
def planted(**replacements: Callable[..., Any]) -> Iterator[None]:
    """Replace the named seams' steps inside the block; an unknown name is an error.

    Objects built inside the block (trainers, decoders) keep what they read, so build
    them inside, from a family no earlier scope has built objects for.
    """
    unknown = sorted(set(replacements) - set(SEAMS))
    if unknown:
        raise KeyError(f"no seam {', '.join(map(repr, unknown))}; seams: {', '.join(SEAMS)}")
    token = _PLANTED.set(MappingProxyType({**_PLANTED.get(), **replacements}))
    try:
        yield
    finally:
        _PLANTED.reset(token)
