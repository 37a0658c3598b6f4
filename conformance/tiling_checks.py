"""Vocab tiling: a loss computed a few rows of logits at a time equals the whole loss.

A tiled loss never holds the ``[batch, seq, vocab]`` logits at once, so it usually
comes with a hand-written backward pass; a backward that drops the cotangent it is
given, or mis-slices the hidden states, still trains, only with wrong gradients. This
check takes one step from the same parameters with and without tiling, on each backend,
and the tiled step across backends. Failures raise
:class:`~conformance.checks.CheckFailure` naming the step and the leaf path.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from conformance.contract import Family
from conformance.core.sharding import MeshSpec
from conformance.train_checks import check_step_variant

VOCAB_TILES = 4
"""Slices the tiled loss cuts the batch's positions into."""


def check_vocab_tiling(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """One step with a :data:`VOCAB_TILES`-tiled loss equals the untiled step.

    Holds on each backend (loss, every gradient, the next state), and across backends
    for the tiled step (:func:`~conformance.train_checks.check_step_variant`). The tiled
    step differentiates the mean loss, so the tiled loss's backward pass receives a
    cotangent other than 1. Tiling must not change the parameters.
    """
    names = ("untiled", f"{VOCAB_TILES} vocab tiles")
    variant = {"vocab_tiles": VOCAB_TILES}
    check_step_variant(family, config, mesh, devices, "vocab_tiling", names, variant)
