"""Vocab tiling: a loss computed a few rows of logits at a time equals the whole loss.

A tiled loss never holds the ``[batch, seq, vocab]`` logits at once, so it usually
comes with a hand-written backward pass; a backward that drops the cotangent it is
given, or mis-slices the hidden states, still trains, only with wrong gradients. This
check takes one step from the same parameters with and without tiling, on each backend,
and the tiled step across backends. Failures raise
:class:`~conformance.checks.CheckFailure` naming the step and the leaf path.
"""

from __future__ import annotations

import functools
from typing import Any

from jax.sharding import Mesh

from conformance.attribution import one_device
from conformance.backends import TransplantError
from conformance.checks import BATCH_SIZE, fail, place_batch
from conformance.families import Family
from conformance.sharding import MeshSpec
from conformance.train_checks import StepResult, advance, compare_steps, linen_and_nnx, params_of
from conformance.training import flat_state
from conformance.trees import Flat

VOCAB_TILES = 4
"""Slices the tiled loss cuts the batch's positions into."""

CHECK = "vocab_tiling"


def _steps(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, start: Flat | None = None
) -> tuple[Flat, tuple[StepResult, StepResult], tuple[StepResult, StepResult]]:
    """One step of both sides untiled and tiled, from one start: ``(start, whole, tiled)``."""
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    linen, nnx_side, mapping = linen_and_nnx(
        family, config, mesh, devices, check=CHECK, start=start
    )
    start = params_of(flat_state(linen.state))
    whole = advance(linen, nnx_side, mapping, batch)
    try:
        tiled = linen_and_nnx(
            family, config, mesh, devices, check=CHECK, start=start, vocab_tiles=VOCAB_TILES
        )
    except TransplantError as err:
        fail(family, CHECK, f"the tiled model's parameters are not the untiled model's: {err}")
    return start, whole, advance(*tiled, batch)


def check_vocab_tiling(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """One step with a :data:`VOCAB_TILES`-tiled loss equals the untiled step.

    Holds on each backend (loss, every gradient, the next state), and across backends
    for the tiled step. The tiled step differentiates the mean loss, so the tiled
    loss's backward pass receives a cotangent other than 1. A failure also says whether
    each result agrees with the same step on one device.
    """
    start, whole, tiled = _steps(family, config, mesh, devices)

    @functools.cache
    def reference() -> tuple[Any, ...]:
        one = one_device(mesh)
        return _steps(family, config, one, one.devices(), start)[1:]

    what = f"one step on mesh {mesh.id}"
    names = ("untiled", f"{VOCAB_TILES} vocab tiles")
    for i, side in enumerate(("Linen", "NNX")):
        compare_steps(
            family,
            CHECK,
            f"{side} {what}",
            whole[i],
            tiled[i],
            names,
            mesh=mesh,
            reference=functools.partial(lambda i: tuple(r[i] for r in reference()), i),
        )
    compare_steps(
        family,
        CHECK,
        f"{VOCAB_TILES} vocab tiles, {what}",
        tiled[0],
        tiled[1],
        mesh=mesh,
        reference=lambda: reference()[1],
    )
