"""State hygiene outside training: what running an NNX model leaves in its state.

An NNX model is a mutable object: a forward called outside ``nnx.capture`` stores what
it sows on the model (flax 0.12 deprecates this but still does it). A sow under a string
name (``self.sow("stats", ...)``) creates a Variable type of that name, which is not
``nnx.Intermediate``, so ``nnx.pop(model, nnx.Intermediate)`` does not take it away;
after any forward outside training (an eval, a library's tracing pass, a forward at
set-up) it stays in the model's state, in the shardings derived from it and in every
checkpoint saved from it. The train-step hygiene check cannot see it: a jitted train step
returns only the state it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from conformance.checks.declare import Axis, declare
from conformance.contract import Backend, Batch
from conformance.core.failure import fail, fail_if_any
from conformance.core.trees import flatten_state, specs, variable_kind
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.checkpoints import CheckpointError, CheckpointInfo, restore, save
from conformance.runtime.sides import NnxSide
from conformance.runtime.sowing import outside_capture


def _eager(model: nnx.Module, batch: Batch) -> Any:
    with outside_capture():
        logits = model(batch.tokens, batch.positions, batch.segment_ids)
    nnx.pop(model, nnx.Intermediate)
    return logits


@nnx.jit
def _jitted(model: nnx.Module, batch: Batch) -> Any:
    return model(batch.tokens, batch.positions, batch.segment_ids)


def _jitted_eval(model: nnx.Module, batch: Batch) -> Any:
    with outside_capture():
        logits = _jitted(model, batch)
    nnx.pop(model, nnx.Intermediate)
    return logits


FORWARDS: dict[str, Callable[[nnx.Module, Batch], Any]] = {
    "an eager forward": _eager,
    "an eval forward under nnx.jit": _jitted_eval,
}
"""How users and libraries run a model outside training: a plain call, then
``nnx.pop(model, nnx.Intermediate)`` as flax documents for taking sown values out."""


def state_drift(before: dict[str, nnx.Variable], after: dict[str, nnx.Variable]) -> list[str]:
    """Leaves that appeared, disappeared or changed Variable type, one line each."""
    lines = [f"{p}: {variable_kind(after[p])} appeared" for p in sorted(after.keys() - before)]
    lines += [f"{p}: {variable_kind(before[p])} disappeared" for p in sorted(before.keys() - after)]
    lines += [
        f"{p}: {variable_kind(before[p])} became {variable_kind(after[p])}"
        for p in sorted(before.keys() & after.keys())
        if type(before[p]) is not type(after[p])
    ]
    return lines


def _persistent(model: nnx.Module) -> dict[str, Any]:
    state = nnx.state(model, nnx.Not(nnx.RngState))
    return {path: var.get_value() for path, var in flatten_state(state).items()}


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="none", devices=False, workdir=True, pair=False)
def check_state_hygiene(case: Case, workdir: Path) -> None:
    """Running the NNX model outside training leaves its state as it was built.

    The freshly built model (the case's config, on no mesh) holds no sown
    intermediate (a forward at set-up would leave one); after each of :data:`FORWARDS`
    (intermediates popped) its state holds exactly the fresh model's leaves, each of the
    same Variable type;
    and a checkpoint of its state saved after an eager forward restores strictly into
    the fresh model's layout.
    """
    runner = NnxSide(case).runner
    batch = case.family.batch(case.bound, BATCH_SIZE)
    built = runner.build(0)
    fresh = flatten_state(nnx.state(built))
    left = [
        f"{path}: {variable_kind(var)}: a forward at set-up left it in the model's state"
        for path, var in fresh.items()
        if isinstance(var, nnx.Intermediate)
    ]
    fail_if_any("the freshly built NNX model holds sown intermediates", left)
    for how, forward in FORWARDS.items():
        model = runner.build(0)
        jax.block_until_ready(forward(model, batch))
        after = flatten_state(nnx.state(model))
        title = (
            f"NNX model state after {how} is not the freshly built model's "
            f"({len(fresh)} leaves built, {len(after)} after); it would reach shardings and "
            "checkpoints"
        )
        fail_if_any(title, state_drift(fresh, after))
    model = runner.build(0)
    _eager(model, batch)
    directory = Path(workdir) / "after-forward"
    info = CheckpointInfo(case.family.name, case.size, Backend.NNX, case.scan_layers)
    save(directory, _persistent(model), info)
    try:
        restore(directory, specs(_persistent(built)))
    except CheckpointError as err:
        fail(f"a checkpoint saved after an eager forward: {err}")
