"""A case: what one check runs on, as a value.

A :class:`Case` is one point of the suite's product: a family's config (size, layer
layout, compute dtype), the mesh it runs on (device or abstract), and a quantization
mode. It is hashable and immutable; a check derives the cases it needs from it (the
same case on one device, with another config, quantized) instead of threading
``(family, config, mesh, devices)`` through every call. Comparisons are between two
*sides* of a case (:mod:`conformance.runtime.sides`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conformance.contract import Batch, Family, LogicalRules, Pair, preferred_layout
from conformance.core.failure import fail_if_any
from conformance.core.sharding import (
    Logical,
    MeshSpec,
    UnknownLogicalAxis,
    one_device,
    resolve_spec,
)

BATCH_SIZE = 8
"""Rows per batch on device meshes: divisible by every default mesh's batch sharding."""


@dataclasses.dataclass(frozen=True)
class Case:
    """A family's config on a mesh, in a quantization mode: what a check runs on.

    ``config`` is the family's config as :meth:`Family.config` made it, not yet bound to
    a mesh; :attr:`bound` is what the sides build (:meth:`Family.with_mesh` on
    ``devices``). Without ``devices`` the mesh is abstract: shardings can be resolved,
    nothing can be placed.
    """

    family: Family
    size: str
    scan_layers: bool
    config: Any
    mesh: MeshSpec | None = None
    devices: Mesh | None = None
    quant: str | None = None
    """A Qwix mode (a name in :data:`conformance.runtime.quant.MODES`), or float."""
    dtype: Any = jnp.float32
    """The compute dtype ``config`` was made with."""
    pair: Pair = Pair.LINEN_NNX
    """The two sides its checks compare (:func:`~conformance.runtime.sides.live_pair`)."""

    @classmethod
    def of(
        cls,
        family: Family,
        size: str | None = None,
        *,
        scan_layers: bool | None = None,
        dtype: Any = jnp.float32,
        mesh: MeshSpec | None = None,
        devices: Mesh | None = None,
        quant: str | None = None,
        pair: Pair = Pair.LINEN_NNX,
    ) -> Case:
        """The case of ``family`` at ``size`` (default: its device size) and layout.

        ``scan_layers`` defaults to the family's preferred layout.
        """
        size = family.device_size if size is None else size
        if scan_layers is None:
            scan_layers = preferred_layout(family)
        config = family.config(size, scan_layers=scan_layers, dtype=dtype)
        return cls(family, size, scan_layers, config, mesh, devices, quant, dtype, pair)

    @property
    def bound(self) -> Any:
        """The config bound to this case's devices, as the sides build it."""
        if self.devices is None:
            return self.config
        return self.family.with_mesh(self.config, self.devices)

    @property
    def runs_here(self) -> bool:
        """Whether this process can run programs on the case's devices.

        Not on a TPU slice described by libtpu only to compile for
        (:mod:`conformance.core.tpu`).
        """
        return self.devices is None or set(self.devices.devices.flat) <= set(jax.devices())

    @property
    def layout(self) -> str:
        """``"scan"`` (layers stacked) or ``"loop"`` (one subtree per layer)."""
        return "scan" if self.scan_layers else "loop"

    def in_dtype(self, dtype: Any) -> Case:
        """The same case with its family's config in compute dtype ``dtype``."""
        config = self.family.config(self.size, scan_layers=self.scan_layers, dtype=dtype)
        return dataclasses.replace(self, config=config, dtype=dtype)

    def with_config(self, config: Any) -> Case:
        """The same case with another (unbound) config of the same family and size."""
        return dataclasses.replace(self, config=config)

    def quantized(self, quant: str | None) -> Case:
        """The same case in the Qwix mode ``quant`` (``None``: float)."""
        return dataclasses.replace(self, quant=quant)

    def on(self, mesh: MeshSpec, devices: Mesh | None = None) -> Case:
        """The same case on ``mesh``: its ``devices``, built when not given."""
        devices = mesh.devices() if devices is None else devices
        return dataclasses.replace(self, mesh=mesh, devices=devices)

    def on_one_device(self) -> Case:
        """The same case on the one-device counterpart of its mesh (the reference)."""
        return self.on(one_device(self._mesh()))

    def _mesh(self) -> MeshSpec:
        if self.mesh is None:
            raise ValueError(f"{self.family.name}: this case has no mesh")
        return self.mesh

    def specs(
        self, logical: Mapping[str, Logical], rules: LogicalRules | None = None
    ) -> dict[str, PartitionSpec]:
        """Every leaf's logical names resolved on the mesh, with ``rules``.

        ``rules`` default to :meth:`Family.axis_rules` of the config (what goldens record).
        A name no rule knows fails the check, each with its path.
        """
        rules = self.family.axis_rules(self.config) if rules is None else rules
        mesh = self._mesh()
        resolved, unknown = {}, []
        for path, names in logical.items():
            try:
                resolved[path] = resolve_spec(names, rules, mesh)
            except UnknownLogicalAxis as err:
                unknown.append(f"{path}: logical axis {err.args[0]!r} has no rule")
        fail_if_any("unknown logical axes", unknown)
        return resolved

    def shardings(self, logical: Mapping[str, Logical]) -> dict[str, NamedSharding]:
        """``{path: NamedSharding}`` on the devices, as every array placed there is.

        Resolved with :meth:`Family.logical_axis_rules`.
        """
        if self.devices is None:
            raise ValueError(f"{self.family.name}: this case's mesh has no devices")
        specs = self.specs(logical, self.family.logical_axis_rules())
        return {path: NamedSharding(self.devices, spec) for path, spec in specs.items()}

    def batch_spec(self) -> PartitionSpec:
        """The batch's ``PartitionSpec``: its first dimension by the family's batch rule."""
        names = (self.family.batch_axis, None)
        return resolve_spec(names, self.family.logical_axis_rules(), self._mesh())

    def batch_sharding(self) -> NamedSharding:
        """The batch's sharding on the devices (:meth:`batch_spec`)."""
        if self.devices is None:
            raise ValueError(f"{self.family.name}: this case's mesh has no devices")
        return NamedSharding(self.devices, self.batch_spec())

    def place(self, batch: Batch) -> Batch:
        """``batch`` with its batch dimension sharded by the family's batch-axis rule."""
        sharding = self.batch_sharding()
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)

    def batch(self, rows: int = BATCH_SIZE) -> Batch:
        """The family's batch of ``rows`` for this config, placed on the devices."""
        return self.place(self.family.batch(self.bound, rows))
