"""Which side moved: a comparison on a mesh, repeated on one device, split into causes.

A sharded computation must give the numbers it gives on one device. When two results
disagree on a mesh (Linen against NNX, a whole batch against micro-batches), the same
two computations on one device tell a partitioning problem (a side that changes when
partitioned) from a real divergence (one that shows on one device too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from conformance.numerics import Mismatch, compare_trees, tolerance_for
from conformance.sharding import MESH_AXES, MeshSpec
from conformance.trees import Flat

Pair = tuple[Flat, Flat]
"""Two sides' results, each ``{path: array}`` with the same paths."""


def one_device(mesh: MeshSpec) -> MeshSpec:
    """The one-device counterpart of ``mesh``: its axes (and the default ones) at size 1.

    Every logical rule still names an existing axis, and every default mesh shares one
    counterpart, so a reference computed for one mesh serves the others.
    """
    names = dict.fromkeys((*MESH_AXES, *mesh.names))
    return MeshSpec(tuple((name, 1) for name in names))


def on_host(flat: Mapping[str, Any]) -> Flat:
    """``flat`` fetched to numpy: a result that holds no device buffer or program."""
    return {path: np.asarray(jax.device_get(value)) for path, value in flat.items()}


def noise_masked(first: Flat, second: Flat) -> tuple[Flat, int]:
    """``second`` with Adam's amplified gradient noise taken from ``first``, and how much.

    One Adam step moves a parameter by about the learning rate times ``g / |g|``, so an
    element whose true gradient is zero (gpt3's key bias) takes a full step in the
    direction of its rounding noise, which partitioning changes. In results with
    ``grads/<p>`` and ``state/[model/]<p>`` leaves, a parameter element whose gradient is
    within ``atol`` of zero in both results is not compared (its gradient still is).
    Returns the adjusted ``second`` and the count of such elements that differed.
    """
    adjusted, masked = dict(second), 0
    for path, value in second.items():
        param = path.removeprefix("state/").removeprefix("model/")
        grad = f"grads/{param}"
        if not path.startswith("state/") or grad not in first or grad not in second:
            continue
        g1, g2 = np.asarray(first[grad]), np.asarray(second[grad])
        atol = tolerance_for(g1.dtype, g2.dtype).atol
        a, b = np.asarray(first[path]), np.asarray(value)
        if a.shape != b.shape or g1.shape != a.shape or g2.shape != a.shape:
            continue
        noise = (np.abs(g1) <= atol) & (np.abs(g2) <= atol)
        masked += int((noise & (a != b)).sum())
        adjusted[path] = np.where(noise, a, b)
    return adjusted, masked


def compare_runs(first: Flat, second: Flat) -> list[Mismatch]:
    """Mismatches between two runs of one computation, Adam's noise steps aside.

    :func:`~conformance.numerics.compare_trees` after :func:`noise_masked`, which
    changes nothing in results without gradients.
    """
    return compare_trees(first, noise_masked(first, second)[0])


def _worst(mismatches: Sequence[Mismatch]) -> str:
    worst = max(mismatches, key=lambda m: m.max_abs)
    return f"{len(mismatches)} leaf(s), worst {worst.path} by {worst.max_abs:.3e}"


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Each side on a mesh against itself on one device, and the two on one device."""

    mesh: str
    names: tuple[str, str]
    moved: tuple[tuple[Mismatch, ...], tuple[Mismatch, ...]]
    """Per side: where its mesh result differs from its own one-device result."""
    apart: tuple[Mismatch, ...]
    """Where the two sides differ from each other on one device."""

    @property
    def movers(self) -> list[str]:
        """The sides whose results change when partitioned on the mesh."""
        return [name for name, found in zip(self.names, self.moved, strict=True) if found]

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
            lines.append(f"{name} on mesh {self.mesh} {state}")
        together = f"differ ({_worst(self.apart)})" if self.apart else "agree"
        lines.append(f"on one device, {a} and {b} {together}")
        movers = " and ".join(self.movers)
        verb = "computes" if len(self.movers) == 1 else "compute"
        if not self.apart and movers:
            verdict = (
                f"a partitioning problem, not a {a}/{b} divergence: {movers} {verb} "
                f"differently when partitioned on mesh {self.mesh}"
            )
        elif self.apart and not movers:
            verdict = (
                f"a {a}/{b} divergence: it shows on one device too, and partitioning "
                "changes neither side"
            )
        elif self.apart:
            verdict = (
                f"a {a}/{b} divergence (it shows on one device too); partitioning on mesh "
                f"{self.mesh} also changes {movers}"
            )
        else:
            verdict = (
                "each side is within tolerance of its one-device result and the two agree "
                f"on one device: the gap on mesh {self.mesh} is rounding at the tolerance's edge"
            )
        return "sharding attribution: " + "; ".join(lines) + f"\n  verdict: {verdict}"


def attribute(mesh: MeshSpec, names: tuple[str, str], on_mesh: Pair, on_one: Pair) -> Attribution:
    """Compare each side of ``on_mesh`` with its one-device result, and those two."""
    moved = (
        tuple(compare_runs(on_one[0], on_mesh[0])),
        tuple(compare_runs(on_one[1], on_mesh[1])),
    )
    return Attribution(mesh.id, names, moved, tuple(compare_runs(*on_one)))


def attribution_text(
    mesh: MeshSpec, names: tuple[str, str], on_mesh: Pair, reference: Callable[[], Pair]
) -> str:
    """:meth:`Attribution.describe` for ``on_mesh``, its one-device pair from ``reference``.

    Never raises: if the one-device run fails, the text says why instead.
    """
    try:
        return attribute(mesh, names, on_mesh, reference()).describe()
    except Exception as err:
        failure = f"{type(err).__name__}: {err}"
        return f"sharding attribution unavailable: the one-device run failed ({failure})"
