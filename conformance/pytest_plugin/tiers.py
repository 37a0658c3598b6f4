"""Tiers: how much of the family x mesh x layout x dtype x mode product a run covers.

The suite generates every combination; a tier keeps some and leaves the rest out (pytest
shows them as deselected). Golden files are claimed by every generated test, so a tier
never reports another tier's goldens as unused.

* ``smoke``: the laptop pass. One multi-axis mesh (``data=2,fsdp=2,tensor=2``, where
  partitioning bugs show), the family's preferred layer layout, float32, one
  quantization mode per method, the same-layout checkpoint conversion, TPU compiles at
  the device size and ``tpu_compile``'s at production sizes (not the probed ones nor the
  planted faults there); every check at least once per family, and the mode pairs of
  the checks comparing what two modes of NNX build and compute (``structure``,
  ``sharding``, ``init``, ``forward``, ``train_step``, ``decode``, ``tree_mode``,
  ``explicit_sharding``), not of those compiling programs of their own
  (:attr:`~conformance.checks.registry.Check.costly_pairs`: ``cost``,
  ``activation_sharding``, ``resume_conversion``).
* ``default``: what CI gates on. Both default meshes (the multi-axis one first, then
  ``fsdp=8``), both layer layouts, float32 and bfloat16 (bfloat16 on the primary mesh),
  one quantization mode per method, every checkpoint conversion; the variant checks
  (quantized, lower-precision, accumulated, tiled steps and forwards) on the primary
  mesh, and they and the checks comparing two modes of NNX (``tree_mode``,
  ``explicit_sharding``) in the family's preferred layout; the mode pairs of the checks
  with a ``pair`` axis on the primary mesh, in the preferred layout, in float32; and
  the tests expected to fail among those combinations (strict xfails), so that a pin
  moved to a release with the fix turns them red where CI gates.
* ``full``: every combination: every quantization mode (fp8 too), and every test
  expected to fail (strict xfails of known upstream bugs and declared divergences).

A mesh given on the command line (``--mesh``) replaces the tier's meshes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conformance.contract import Family
    from conformance.core.sharding import MeshSpec


class TierError(ValueError):
    """An unknown tier name."""


@dataclasses.dataclass(frozen=True)
class Tier:
    """Which combinations a run keeps; ``None`` on a field keeps every value."""

    name: str
    summary: str
    meshes: tuple[str, ...] | None
    """Mesh ids kept, in order (the first is the primary mesh); ``None``: all configured."""
    one_layout: bool
    """Keep only the family's first layer layout (``Capabilities.scan_layers[0]``)."""
    dtypes: tuple[str, ...] | None
    """Compute dtype ids kept (``f32``, ``bf16``)."""
    one_mode_per_method: bool
    """Keep one quantization mode per method (the first of
    :data:`~conformance.runtime.quant.MODES` the family has)."""
    same_layout_conversions: bool
    """Keep only checkpoint conversions between equal layer layouts."""
    expected_failures: bool
    """Keep tests marked as expected to fail."""
    costly_tpu_production: bool = True
    """Keep the TPU compiles at production sizes (``--tpu ...@production``) beyond
    ``tpu_compile``'s own: probed programs
    (:attr:`~conformance.checks.registry.Check.costly_production`) and planted faults."""
    low_precision_on_primary: bool = False
    """Keep dtypes below float32 on the primary mesh (the first of ``meshes``) only."""
    variants_on_primary: bool = False
    """Keep the variant checks (quantized, lower-precision, accumulated, tiled steps and
    forwards: :attr:`~conformance.checks.registry.Check.variant`) and the mode pairs
    (two modes of the NNX model on the ``pair`` axis) on the primary mesh only."""
    variants_one_layout: bool = False
    """Keep the variant checks and the checks comparing two modes of the NNX model
    (:attr:`~conformance.checks.registry.Check.mode_pair`) in the family's preferred
    layer layout only."""
    mode_pairs_in_f32: bool = False
    """Keep the mode pairs (two modes of the NNX model on the ``pair`` axis) in float32
    compute only."""
    costly_mode_pairs: bool = True
    """Keep the mode pairs of the checks whose mode pairs compile programs of their own
    (:attr:`~conformance.checks.registry.Check.costly_pairs`)."""

    def narrowing(self, dtypes: Iterable[str]) -> list[str]:
        """What the tier keeps beyond its meshes, in words, for a run's header.

        ``dtypes``: the dtype ids a run can have, named when the tier keeps them all.
        """
        return [
            "one layer layout per family" if self.one_layout else "every layer layout",
            "dtypes "
            + ", ".join(self.dtypes or dtypes)
            + (" (below f32 on the primary mesh only)" if self.low_precision_on_primary else ""),
            "one quantization mode per method" if self.one_mode_per_method else "every mode",
            *(
                ["variant checks and NNX mode pairs on the primary mesh only"]
                if self.variants_on_primary
                else []
            ),
            *(
                ["variant checks and NNX mode pairs in one layer layout"]
                if self.variants_one_layout
                else []
            ),
            *(["NNX mode pairs in f32 only"] if self.mode_pairs_in_f32 else []),
            *(
                []
                if self.costly_mode_pairs
                else ["NNX mode pairs of the checks compiling programs of their own left out"]
            ),
            *(
                []
                if self.costly_tpu_production
                else ["TPU compiles at production sizes: tpu_compile's only"]
            ),
            "expected failures run" if self.expected_failures else "expected failures left out",
        ]

    def mesh_order(self, configured: Sequence[MeshSpec]) -> list[MeshSpec]:
        """The configured meshes this tier runs on, the primary one first."""
        if self.meshes is None:
            return list(configured)
        by_id = {m.id: m for m in configured}
        return [by_id[i] for i in self.meshes if i in by_id]

    def leaves_out(self, family: Family, facets: Mapping[str, Any]) -> str:
        """Why this tier leaves out the test of ``family`` with ``facets``; ``""`` if kept.

        ``facets`` describe a test by name: ``mesh`` (a device mesh), ``variant`` (a
        variant check, :attr:`~conformance.checks.registry.Check.variant`), ``mode_pair`` (a
        check comparing two modes of NNX, :attr:`~conformance.checks.registry.Check.mode_pair`),
        ``costly_mode_pair`` (a mode pair compiling programs of its own),
        ``scan_layers``, ``dtype`` (its id, ``f32`` or ``bf16``), ``quant``, ``layouts``
        (a checkpoint conversion's source and target layouts, ``True``: scanned) and
        ``costly_tpu_production`` (a TPU compile at production sizes beyond
        ``tpu_compile``'s: probed, or of a planted fault); a test lacking one is not
        narrowed by it.
        """
        from conformance.contract import preferred_layout

        mesh = facets.get("mesh")
        if mesh is not None and self.meshes is not None and mesh.id not in self.meshes:
            return f"mesh {mesh.id}"
        preferred = preferred_layout(family)
        scan = facets.get("scan_layers")
        if self.one_layout and scan is not None and scan != preferred:
            return f"layout {'scan' if scan else 'loop'}"
        narrowed = facets.get("variant") or facets.get("mode_pair")
        if self.variants_one_layout and narrowed and scan is not None and scan != preferred:
            what = "variant check" if facets.get("variant") else "mode pair"
            kept = "scan" if preferred else "loop"
            return f"{what} in layout {'scan' if scan else 'loop'} (only in {kept})"
        dtype = facets.get("dtype")
        if dtype and self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype}"
        if self.mode_pairs_in_f32 and facets.get("mode_pair") and dtype not in (None, "f32"):
            return f"mode pair in dtype {dtype} (only in f32)"
        if not self.costly_mode_pairs and facets.get("costly_mode_pair"):
            return "mode pair compiling programs of its own (in the default tier)"
        primary = self.meshes[0] if self.meshes else None
        off_primary = primary is not None and mesh is not None and mesh.id != primary
        if off_primary and self.low_precision_on_primary and dtype not in (None, "f32"):
            return f"dtype {dtype} on mesh {mesh.id} (only on the primary mesh, {primary})"
        if off_primary and self.variants_on_primary and narrowed:
            what = "variant check" if facets.get("variant") else "mode pair"
            return f"{what} on mesh {mesh.id} (only on the primary mesh, {primary})"
        quant = facets.get("quant")
        if self.one_mode_per_method and quant is not None and quant != _first_mode(family, quant):
            return f"quantization mode {quant}"
        if not self.costly_tpu_production and facets.get("costly_tpu_production"):
            return "production-size TPU compiles beyond tpu_compile's (in the default tier)"
        pair = facets.get("layouts")
        if self.same_layout_conversions and pair is not None:
            source, target = pair
            if source != target or (self.one_layout and source != preferred):
                return "checkpoint conversion " + "-".join("scan" if s else "loop" for s in pair)
        return ""


def _first_mode(family: Family, quant: str) -> str:
    """The first mode of :data:`MODES` that ``family`` declares with ``quant``'s method."""
    from conformance.contract import quantization_modes
    from conformance.runtime.quant import MODES

    method = MODES[quant].method
    declared = quantization_modes(family)
    return next(m for m in MODES if m in declared and MODES[m].method == method)


TIERS: dict[str, Tier] = {
    tier.name: tier
    for tier in (
        Tier(
            "smoke",
            "the laptop pass: every check once per family",
            meshes=("data2-fsdp2-tensor2",),
            one_layout=True,
            dtypes=("f32",),
            one_mode_per_method=True,
            same_layout_conversions=True,
            expected_failures=False,
            costly_tpu_production=False,
            costly_mode_pairs=False,
        ),
        Tier(
            "default",
            "what CI gates on",
            meshes=("data2-fsdp2-tensor2", "fsdp8"),
            one_layout=False,
            dtypes=None,
            one_mode_per_method=True,
            same_layout_conversions=False,
            expected_failures=True,
            low_precision_on_primary=True,
            variants_on_primary=True,
            variants_one_layout=True,
            mode_pairs_in_f32=True,
        ),
        Tier(
            "full",
            "every combination, with the expected failures",
            meshes=None,
            one_layout=False,
            dtypes=None,
            one_mode_per_method=False,
            same_layout_conversions=False,
            expected_failures=True,
        ),
    )
}
"""Every tier, by name, cheapest first."""

DEFAULT_TIER = "default"


def get_tier(name: str) -> Tier:
    """The tier called ``name``; a :class:`TierError` lists the valid ones."""
    if name not in TIERS:
        valid = ", ".join(f"{t.name} ({t.summary})" for t in TIERS.values())
        raise TierError(f"unknown tier {name!r}; valid tiers: {valid}")
    return TIERS[name]
