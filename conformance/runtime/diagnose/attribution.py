"""Which side moved: a comparison on a mesh, repeated on one device, split into causes.

A sharded computation must give the numbers it gives on one device. When two results
disagree on a mesh (Linen against NNX, a whole batch against micro-batches), the same
two computations on one device tell a partitioning problem (a side that changes when
partitioned) from a real divergence (one that shows on one device too). On a mesh of one
device nothing is partitioned: there a side that moves ran the same computation twice
and got two answers, which only a backend that is not run-to-run deterministic gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from conformance.core.distributed import host_array
from conformance.core.environment import GPU_DETERMINISTIC_FLAG
from conformance.core.numerics import Mismatch, compare_trees, tolerance_for
from conformance.core.sharding import MeshSpec
from conformance.core.trees import Flat

Pair = tuple[Flat, Flat]
"""Two sides' results, each ``{path: array}`` with the same paths."""


def on_host(flat: Mapping[str, Any]) -> Flat:
    """``flat`` fetched to numpy: a result that holds no device buffer or program."""
    return {path: host_array(value) for path, value in flat.items()}


def noise_masked(first: Flat, second: Flat, *, sign_noise: bool = False) -> tuple[Flat, int]:
    """``second`` with Adam's amplified gradient noise taken from ``first``, and how much.

    One Adam step moves a parameter by about the learning rate times ``g / |g|``, so an
    element whose true gradient is zero (gpt3's key bias) takes a full step in the
    direction of its rounding noise, which partitioning changes. In results with
    ``grads/<p>`` and ``state/[model/]<p>`` leaves, a parameter element whose gradient is
    within ``atol`` of zero in both results is not compared (its gradient still is).
    With ``sign_noise``, nor is one whose two gradients are no farther from zero than
    from each other: where the gradients themselves are judged by rounding (bfloat16
    compute), Adam's direction there is decided by that accepted difference.
    Returns the adjusted ``second`` and the count of such elements that differed.
    """
    adjusted, masked = dict(second), 0
    for path, value in second.items():
        param = path.removeprefix("state/").removeprefix("model/")
        grad = f"grads/{param}"
        if not path.startswith("state/") or grad not in first or grad not in second:
            continue
        g1, g2 = host_array(first[grad]), host_array(second[grad])
        atol = tolerance_for(g1.dtype, g2.dtype).atol
        a, b = host_array(first[path]), host_array(value)
        if a.shape != b.shape or g1.shape != a.shape or g2.shape != a.shape:
            continue
        noise = (np.abs(g1) <= atol) & (np.abs(g2) <= atol)
        if sign_noise:
            noise |= np.minimum(np.abs(g1), np.abs(g2)) <= np.abs(g1 - g2)
        masked += int((noise & (a != b)).sum())
        adjusted[path] = np.where(noise, a, b)
    return adjusted, masked


def compare_runs(first: Flat, second: Flat) -> list[Mismatch]:
    """Mismatches between two runs of one computation, Adam's noise steps aside.

    :func:`~conformance.core.numerics.compare_trees` after :func:`noise_masked`, which
    changes nothing in results without gradients.
    """
    return compare_trees(first, noise_masked(first, second)[0])


def _worst(mismatches: Sequence[Mismatch]) -> str:
    worst = max(mismatches, key=lambda m: m.max_abs)
    return f"{len(mismatches)} leaf(s), worst {worst.path} by {worst.max_abs:.3e}"


_QUANTIZED_MOVE = (
    "a quantized computation moves when partitioned without a partitioning problem: "
    "partitioning reorders float sums, and a rounding-level change moves values across "
    "quantization steps"
)


def rerun_differs(names: Sequence[str], mesh: MeshSpec) -> str:
    """Why ``names`` on the one-device ``mesh`` differ from their own one-device runs.

    Nothing is partitioned on one device, so the two runs are one computation run twice.
    """
    verb = "gives" if len(names) == 1 else "give"
    return (
        f"mesh {mesh.id} is one device, so nothing is partitioned: {' and '.join(names)} "
        f"{verb} different numbers for the same computation run twice. The backend is not "
        "run-to-run deterministic (on a GPU, XLA's atomic reductions; "
        f"XLA_FLAGS={GPU_DETERMINISTIC_FLAG} makes them deterministic): not a "
        "partitioning problem"
    )


def _spread_covers(path: str, on_mesh: Pair, on_one: Pair) -> bool:
    """Whether, in leaf ``path``, each side moves when partitioned by as much as they differ.

    Each side's move (its mesh result against its one-device result) must be at least
    the sides' difference on the mesh both in the worst absolute difference and in L2
    norm, every value finite: a move concentrated in a few elements (one crossed
    quantization step) does not cover a difference spread over many.
    """
    if any(path not in flat for flat in (*on_mesh, *on_one)):
        return False
    first, second, one_first, one_second = (
        np.asarray(host_array(flat[path]), np.float64) for flat in (*on_mesh, *on_one)
    )
    if len({x.shape for x in (first, second, one_first, one_second)}) != 1:
        return False
    if not all(np.isfinite(x).all() for x in (first, second, one_first, one_second)):
        return False

    def size(difference: np.ndarray) -> tuple[float, float]:
        return float(np.max(np.abs(difference), initial=0.0)), float(np.linalg.norm(difference))

    gap = size(first - second)
    moves = (size(first - one_first), size(second - one_second))
    return all(move[i] >= gap[i] for move in moves for i in (0, 1))


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Each side on a mesh against itself on one device, and the two on one device.

    With the two sides' difference on the mesh (:attr:`gap`) and whether partitioning
    alone explains it (:attr:`within_spread`).
    """

    mesh: MeshSpec
    names: tuple[str, str]
    moved: tuple[tuple[Mismatch, ...], tuple[Mismatch, ...]]
    """Per side: where its mesh result differs from its own one-device result."""
    apart: tuple[Mismatch, ...]
    """Where the two sides differ from each other on one device."""
    quantized: bool = False
    """The computation rounds to a quantization grid: a side's move on the mesh is
    expected (a rounding-level change crosses grid steps), so only ``apart`` decides."""
    gap: tuple[Mismatch, ...] = ()
    """Where the two sides differ from each other on the mesh."""
    within_spread: bool = False
    """The sides agree on one device, and in every leaf where they differ on the mesh,
    each moves from its own one-device result by at least as much (:func:`attribute`).
    Then the gap is rounding inside two partitioned programs, which a quantized or
    bfloat16 comparison amplifies: not a divergence between the sides."""

    @property
    def drifted(self) -> list[str]:
        """The sides whose mesh results differ from their one-device results."""
        return [name for name, found in zip(self.names, self.moved, strict=True) if found]

    @property
    def movers(self) -> list[str]:
        """The sides whose results change when partitioned on the mesh (none if quantized)."""
        return [] if self.quantized else self.drifted

    def describe(self) -> str:
        """Which side moved when partitioned, and the likely cause, in a few lines."""
        a, b = self.names
        lines = []
        for name, found in zip(self.names, self.moved, strict=True):
            state = (
                f"differs from itself on one device ({_worst(found)})"
                if found
                else "agrees with itself on one device"
            )
            lines.append(f"{name} on mesh {self.mesh.id} {state}")
        together = f"differ ({_worst(self.apart)})" if self.apart else "agree"
        lines.append(f"on one device, {a} and {b} {together}")
        quantized_move = self.quantized and any(self.moved) and self.mesh.size > 1
        note = f"\n  {_QUANTIZED_MOVE}" if quantized_move else ""
        verdict = f"\n  verdict: {self._verdict()}"
        return "sharding attribution: " + "; ".join(lines) + note + verdict

    def _verdict(self) -> str:
        a, b = self.names
        if self.mesh.size == 1 and self.drifted:
            return rerun_differs(self.drifted, self.mesh)
        if self.within_spread:
            return (
                f"not a {a}/{b} divergence: the two agree on one device, and on mesh "
                f"{self.mesh.id} each moves from its own one-device result by as much as "
                f"they differ there ({_worst(self.gap)}): rounding inside two partitioned "
                "programs, which a quantized or bfloat16 comparison accepts and a float32 "
                "one holds to its tolerance"
            )
        movers = " and ".join(self.movers)
        verb = "computes" if len(self.movers) == 1 else "compute"
        if self.apart and self.quantized:
            return f"a {a}/{b} divergence: it shows on one device too"
        if self.apart and not movers:
            return (
                f"a {a}/{b} divergence: it shows on one device too, and partitioning changes "
                "neither side"
            )
        if self.apart:
            return (
                f"a {a}/{b} divergence (it shows on one device too); partitioning on mesh "
                f"{self.mesh.id} also changes {movers}"
            )
        if self.quantized:
            return (
                f"a partitioning problem, not a {a}/{b} divergence: the two agree on one "
                f"device and differ only when partitioned on mesh {self.mesh.id}, where their "
                "programs round differently and quantization turns that into whole steps"
            )
        if movers:
            return (
                f"a partitioning problem, not a {a}/{b} divergence: {movers} {verb} "
                f"differently when partitioned on mesh {self.mesh.id}"
            )
        return (
            "each side is within tolerance of its one-device result and the two agree "
            f"on one device: the gap on mesh {self.mesh.id} is rounding at the tolerance's edge"
        )


def attribute(
    mesh: MeshSpec, names: tuple[str, str], on_mesh: Pair, on_one: Pair, *, quantized: bool = False
) -> Attribution:
    """Compare each side of ``on_mesh`` with its one-device result, those two, and the sides.

    The sides on the mesh decide :attr:`Attribution.within_spread` (leaf by leaf, each
    side's move covers the gap in worst absolute difference and in L2 norm, every value
    finite).

    ``quantized``: the results come through a quantization grid (see
    :attr:`Attribution.quantized`).
    """
    moved = (
        tuple(compare_runs(on_one[0], on_mesh[0])),
        tuple(compare_runs(on_one[1], on_mesh[1])),
    )
    apart, gap = tuple(compare_runs(*on_one)), tuple(compare_runs(*on_mesh))
    spread = mesh.size > 1 and not apart and bool(gap)
    spread = spread and all(_spread_covers(m.path, on_mesh, on_one) for m in gap)
    return Attribution(mesh, names, moved, apart, quantized, gap, spread)


def attribution_of(
    mesh: MeshSpec,
    names: tuple[str, str],
    on_mesh: Pair,
    reference: Callable[[], Pair],
    *,
    quantized: bool = False,
) -> Attribution | str:
    """:func:`attribute` of ``on_mesh`` and its one-device pair from ``reference``.

    Never raises: if the one-device run fails, a text that says why instead.
    """
    try:
        return attribute(mesh, names, on_mesh, reference(), quantized=quantized)
    except Exception as err:
        failure = f"{type(err).__name__}: {err}"
        return f"sharding attribution unavailable: the one-device run failed ({failure})"


def attribution_text(found: Attribution | str) -> str:
    """What :func:`attribution_of` found, in words."""
    return found.describe() if isinstance(found, Attribution) else found
