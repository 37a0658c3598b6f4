"""Sharding invariance: each backend on a mesh computes what it computes on one device.

Sharding annotations choose where data lives, never what is computed. The check runs
each backend's forward and one train step from the same parameters and batch on the
mesh and on one device (the case's one-device reference), and compares the logits, the
loss, every gradient and the whole next state under the tolerance policy, except
updated parameter elements whose gradient is rounding noise on both runs
(:func:`~conformance.runtime.diagnose.attribution.noise_masked`: Adam turns that noise
into a full step). The one-device results are kept on the host and computed once per
family and config.

A partitioned program sums in another order than the one-device one, and where a sum
cancels, or a value sits on a rounding boundary, that moves a result by far more than
the policy's relative tolerance of the result itself. So when the comparison fails, the
one-device run is repeated from its parameters nudged by one ulp (:func:`nudged`), and
an element outside tolerance is accepted where it lies between the one-device and the
nudged results, in a leaf no farther from one device than twice the nudges move it
(:func:`~conformance.core.rounding.nudge_covered`); the report counts them. On a
2-core AMD EPYC (AVX2), maxtext 0.2.4's ``gpt3`` (Linen and NNX) on
``data=2,fsdp=2,tensor=2`` differs from one device in 2 of 4,096 elements of the token
embedding's gradient (MaxText rounds it to bfloat16), by 2.1e-5 (2.4e-3 relative); a
one-ulp nudge moves the one-device run to the mesh's value there.
"""

from __future__ import annotations

from conformance.checks.declare import BACKENDS, ON_MESH, declare
from conformance.checks.kernel import step_tree, train_pair
from conformance.core.failure import fail
from conformance.core.numerics import compare_trees, report
from conformance.core.records import emit, listening, measure
from conformance.core.rounding import NUDGE_SEEDS, nudge_covered, one_ulp_nudge
from conformance.core.scope import kept, scoped
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.diagnose.attribution import noise_masked, on_host, rerun_differs
from conformance.runtime.sides import SIDES


def _results(case: Case, start: Flat | None) -> tuple[Flat, dict[str, Flat]]:
    """Both backends' logits and one step from ``start``: ``(start, {backend: results})``."""
    pair = train_pair(case, start)
    batch = case.batch()
    start = pair[0].initial
    logits = [training.side.forward(training.params(), batch)[0] for training in pair]
    steps = [training.advance(batch) for training in pair]
    return start, {
        training.side.backend: {"logits": logits[i], **step_tree(steps[i])}
        for i, training in enumerate(pair)
    }


@kept
def reference(case: Case) -> tuple[Flat, dict[str, Flat]]:
    """On the one-device ``case``: Linen's initial parameters and both backends' results.

    Host arrays only, so they outlive the programs that computed them.
    """
    start, results = _results(case, None)
    return on_host(start), {backend: on_host(flat) for backend, flat in results.items()}


@kept
def nudged(case: Case) -> list[dict[str, Flat]]:
    """On the one-device ``case``: both backends' results from one-ulp-nudged parameters.

    The reference's parameters nudged by :func:`~conformance.core.rounding.one_ulp_nudge`,
    one ``{backend: results}`` per seed of :data:`~conformance.core.rounding.NUDGE_SEEDS`.
    The reference's own programs compute them (compiled again only if a release dropped
    them); host arrays only, computed once per family and config (the check asks for them
    only when its comparison fails).
    """
    start, _ = reference(case)
    return [
        {b: on_host(flat) for b, flat in _results(case, one_ulp_nudge(start, seed))[1].items()}
        for seed in NUDGE_SEEDS
    ]


@scoped
def _on_mesh(case: Case) -> dict[str, Flat]:
    start, _ = reference(case.on_one_device())
    return _results(case, start)[1]


@declare(ON_MESH, BACKENDS, pair=False)
def check_sharding_invariance(case: Case, backend: str) -> None:
    """``backend`` on the case's mesh gives its one-device logits, loss, gradients and state.

    Both runs start from the same parameters (Linen's, transplanted for NNX) and batch.
    A failure names the backend, the mesh and every leaf that moved.
    """
    if backend not in SIDES:
        raise ValueError(f"unknown backend {backend!r}; use one of {tuple(SIDES)}")
    name, mesh = SIDES[backend].name, case.mesh
    _, expected = reference(case.on_one_device())
    actual, masked = noise_masked(expected[backend], _on_mesh(case)[backend])
    found, covered = compare_trees(expected[backend], actual), 0
    if found:
        moved = [run[backend] for run in nudged(case.on_one_device())]
        uncovered, covered = nudge_covered(expected[backend], actual, moved)
        found = compare_trees(expected[backend], uncovered)
    names = ("one device", f"mesh {mesh.id}")
    if listening():
        title = f"{name} on mesh {mesh.id} against one device"
        emit(measure(title, expected[backend], actual, found, names=names))
    if found:
        title = (
            f"{name} on mesh {mesh.id} against {name} on one device, from the same "
            "parameters and batch (forward logits, then one train step; "
            f"{masked} updated parameter element(s) with a gradient within atol of zero "
            f"not compared; {covered} element(s) accepted where a one-ulp nudge of the "
            "parameters moves the one-device run as far)"
        )
        cause = rerun_differs([name], mesh) if mesh.size == 1 else _partitioned(name, mesh.id)
        fail(report(title, found, names) + f"\n  {cause}")


def _partitioned(name: str, mesh: str) -> str:
    return (
        f"{name} computes differently when partitioned on mesh {mesh}. "
        "Sharding annotations choose where data lives, never what is computed: this is a "
        "partitioning problem (an annotation or constraint that XLA's SPMD partitioner "
        "miscomputes, often with an '[SPMD] Involuntary full rematerialization' warning "
        "in the log, or a collective over the wrong mesh axis), not a Linen/NNX divergence"
    )
