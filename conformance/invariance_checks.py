"""Sharding invariance: each backend on a mesh computes what it computes on one device.

Sharding annotations choose where data lives, never what is computed. The check runs
each backend's forward and one train step from the same parameters and batch on the
mesh and on one device (:func:`~conformance.runtime.diagnose.attribution.one_device`), and
compares the logits, the loss, every gradient and the whole next state under the
tolerance policy, except updated parameter elements whose gradient is rounding noise on
both runs (:func:`~conformance.runtime.diagnose.attribution.noise_masked`: Adam turns that
noise into a full step).
The one-device results are kept on the host and computed once per family and config.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from conformance.checks import BATCH_SIZE, fail, place_batch
from conformance.contract import Family
from conformance.core.numerics import compare_trees, report
from conformance.core.records import emit, listening, measure
from conformance.core.scope import kept, scoped
from conformance.core.sharding import MeshSpec
from conformance.core.trees import Flat
from conformance.runtime.diagnose.attribution import noise_masked, on_host, one_device
from conformance.runtime.training import flat_state
from conformance.train_checks import advance, linen_and_nnx, params_of, step_tree

CHECK = "sharding_invariance"
BACKENDS = ("Linen", "NNX")


def _results(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, start: Flat | None
) -> tuple[Flat, dict[str, Flat]]:
    """Both backends' logits and one step from ``start``: ``(start, {backend: results})``."""
    linen, nnx_side, mapping = linen_and_nnx(
        family, config, mesh, devices, check=CHECK, start=start
    )
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    start = params_of(flat_state(linen.state))
    logits = [
        side.trainer.runner.forward(params_of(flat_state(side.state)), batch)[0]
        for side in (linen, nnx_side)
    ]
    steps = advance(linen, nnx_side, mapping, batch)
    return start, {
        backend: {"logits": logits[i], **step_tree(steps[i])} for i, backend in enumerate(BACKENDS)
    }


@kept
def reference(family: Family, config: Any, mesh: MeshSpec) -> tuple[Flat, dict[str, Flat]]:
    """On the one-device ``mesh``: Linen's initial parameters and both backends' results.

    Host arrays only, so they outlive the programs that computed them.
    """
    start, results = _results(family, config, mesh, mesh.devices(), None)
    return on_host(start), {backend: on_host(flat) for backend, flat in results.items()}


@scoped
def _on_mesh(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> dict[str, Flat]:
    start, _ = reference(family, config, one_device(mesh))
    return _results(family, config, mesh, devices, start)[1]


def check_sharding_invariance(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, backend: str
) -> None:
    """``backend`` on ``devices`` gives its one-device logits, loss, gradients and next state.

    Both runs start from the same parameters (Linen's, transplanted for NNX) and batch.
    A failure names the backend, the mesh and every leaf that moved.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    _, expected = reference(family, config, one_device(mesh))
    actual, masked = noise_masked(
        expected[backend], _on_mesh(family, config, mesh, devices)[backend]
    )
    found = compare_trees(expected[backend], actual)
    names = ("one device", f"mesh {mesh.id}")
    if listening():
        title = f"{backend} on mesh {mesh.id} against one device"
        emit(measure(title, expected[backend], actual, found, names=names))
    if found:
        title = (
            f"{backend} on mesh {mesh.id} against {backend} on one device, from the same "
            "parameters and batch (forward logits, then one train step; "
            f"{masked} updated parameter element(s) with a gradient within atol of zero "
            "not compared)"
        )
        fail(
            family,
            CHECK,
            report(title, found, names)
            + f"\n  {backend} computes differently when partitioned on mesh {mesh.id}. "
            "Sharding annotations choose where data lives, never what is computed: this is a "
            "partitioning problem (an annotation or constraint that XLA's SPMD partitioner "
            "miscomputes, often with an '[SPMD] Involuntary full rematerialization' warning "
            "in the log, or a collective over the wrong mesh axis), not a Linen/NNX divergence",
        )
