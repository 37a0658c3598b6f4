"""TPU topologies as compile targets on a host without a TPU.

libtpu (the ``tpu`` extra) compiles for a TPU slice it is not running on:
``jax.experimental.topologies.get_topology_desc`` returns the slice's devices, and a
program lowered with shardings on a mesh of them compiles to a real TPU executable whose
cost and memory analyses and optimised HLO can be read. Nothing runs there.

:class:`Topology` is a slice by name (``v5p:4x4x4``); :class:`TpuTarget` is one with the
mesh the harness builds over it and the sizes it compiles there (the family's device
size on a small slice, its production sizes on a large one). :data:`HBM_GIB` is each
generation's memory per chip, with where Google documents it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from conformance.core.sharding import MeshSpec, MeshSpecError, parse_mesh

HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
"""High-bandwidth memory per chip, in GiB, by TPU generation, as Google documents it:
https://cloud.google.com/tpu/docs/v4 (32 GiB), https://cloud.google.com/tpu/docs/v5e
(16 GiB), https://cloud.google.com/tpu/docs/v5p (95 GiB),
https://cloud.google.com/tpu/docs/v6e (32 GiB)."""

SETUP = "make setup-tpu (pip install 'linen-nnx-conformance[tpu]')"
"""How to get libtpu: the command a usage error names."""

TARGET_FORMS = (
    "'GEN:AxB[xC]' (e.g. 'v6e:2x4'), optionally '@production' to compile each "
    "production size instead of the device size, and '=MESH' for the mesh over its chips "
    "(e.g. 'v5p:4x4x4@production=fsdp=32,tensor=2')"
)
_TOPOLOGY = re.compile(r"^(?P<gen>v[0-9][a-z]*):(?P<dims>[1-9][0-9]*(?:x[1-9][0-9]*){1,2})$")


class TopologyError(ValueError):
    """A TPU topology or target string is malformed, or libtpu cannot provide it."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice by libtpu's name: generation and chip grid (``v5p:4x4x4``)."""

    generation: str
    grid: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Topology:
        """The topology ``text`` names; :class:`TopologyError` in one line if malformed."""
        found = _TOPOLOGY.match(text.strip())
        if found is None:
            raise TopologyError(f"TPU topology {text!r} is not of the form 'GEN:AxB[xC]'")
        generation = found.group("gen")
        if generation not in HBM_GIB:
            known = ", ".join(HBM_GIB)
            raise TopologyError(
                f"TPU topology {text!r}: unknown generation {generation!r} (known: {known})"
            )
        return cls(generation, tuple(int(d) for d in found.group("dims").split("x")))

    @property
    def name(self) -> str:
        """The name libtpu knows it by (``v5p:4x4x4``)."""
        return f"{self.generation}:{'x'.join(map(str, self.grid))}"

    @property
    def id(self) -> str:
        """The name as it appears in test ids and golden file names (``v5p-4x4x4``)."""
        return self.name.replace(":", "-")

    @property
    def chips(self) -> int:
        """How many chips the slice has."""
        return math.prod(self.grid)

    @property
    def hbm_bytes(self) -> int:
        """Memory per chip, in bytes (:data:`HBM_GIB`)."""
        return HBM_GIB[self.generation] * 2**30

    def __str__(self) -> str:
        return self.name


def default_mesh(chips: int) -> MeshSpec:
    """The mesh the harness builds over ``chips`` chips unless told otherwise.

    ``tensor=2`` and the rest ``fsdp``, with ``data=2`` from 8 chips on (as the CPU's
    primary mesh, ``data=2,fsdp=2,tensor=2``, on 8).
    """
    if chips < 2 or chips % 2:
        return MeshSpec((("fsdp", chips),))
    if chips >= 8 and chips % 4 == 0:
        return MeshSpec((("data", 2), ("fsdp", chips // 4), ("tensor", 2)))
    return MeshSpec((("fsdp", chips // 2), ("tensor", 2)))


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU slice the harness compiles for: its mesh, and whether at production sizes."""

    topology: Topology
    mesh: MeshSpec
    production: bool = False
    """Compile each production size (every size but the device size), not the device size."""

    @classmethod
    def parse(cls, text: str) -> TpuTarget:
        """The target ``text`` names (:data:`TARGET_FORMS`); :class:`TopologyError` if not."""
        name, _, mesh_text = text.partition("=")
        name, _, scale = name.partition("@")
        if scale not in ("", "production"):
            raise TopologyError(f"TPU target {text!r}: '@{scale}' is not '@production'")
        return cls._of(text, name, mesh_text, bool(scale))

    @classmethod
    def _of(cls, text: str, name: str, mesh_text: str, production: bool) -> TpuTarget:
        """The target of slice ``name`` and mesh ``mesh_text``; errors quote ``text``."""
        topology = Topology.parse(name)
        try:
            mesh = parse_mesh(mesh_text) if mesh_text else default_mesh(topology.chips)
        except MeshSpecError as err:
            raise TopologyError(f"TPU target {text!r}: {err}") from None
        if mesh.size != topology.chips:
            raise TopologyError(
                f"TPU target {text!r}: mesh {mesh.id} needs {mesh.size} chips; "
                f"{topology.name} has {topology.chips}"
            )
        return cls(topology, mesh, production)

    @property
    def id(self) -> str:
        """Its id in test ids and golden file names (``v5p-4x4x4-data2-fsdp16-tensor2``)."""
        return f"{self.topology.id}-{self.mesh.id}"

    @property
    def spec(self) -> str:
        """The ``--tpu`` value that names it (:meth:`parse` reads it back)."""
        scale = "@production" if self.production else ""
        return f"{self.topology.name}{scale}={self.mesh.id}"

    def sizes(self, family_sizes: tuple[str, ...]) -> tuple[str, ...]:
        """Which of a family's sizes it compiles: the production ones or the device size."""
        return family_sizes[1:] if self.production else family_sizes[:1]

    def devices(self) -> Any:
        """A ``jax.sharding.Mesh`` of :attr:`mesh`'s shape over the slice's devices."""
        from jax.experimental import mesh_utils
        from jax.sharding import AxisType, Mesh

        grid = mesh_utils.create_device_mesh(
            self.mesh.shape,
            list(slice_devices(self.topology.name)),
            allow_split_physical_axes=True,
        )
        return Mesh(grid, self.mesh.names, axis_types=(AxisType.Auto,) * len(self.mesh.axes))

    def __str__(self) -> str:
        scale = "production sizes" if self.production else "device size"
        return f"{self.topology.name} ({self.topology.chips} chips, {self.mesh.id}, {scale})"


@dataclasses.dataclass(frozen=True)
class TpuCompile:
    """One size and layer layout of a family compiled for one TPU target.

    A value of the ``tpu`` axis.
    """

    target: TpuTarget
    size: str
    scan_layers: bool

    @property
    def id(self) -> str:
        """Its id in test ids and golden file names (``8b-v5p-4x4x4-data2-fsdp16-tensor2-scan``)."""
        return f"{self.size}-{self.target.id}-{'scan' if self.scan_layers else 'loop'}"


def compiles(
    targets: tuple[TpuTarget, ...],
    sizes: tuple[str, ...],
    layouts: tuple[bool, ...],
    placed: Mapping[TpuTarget, Mapping[str, TpuTarget]] | None = None,
) -> list[TpuCompile]:
    """What a family of ``sizes`` and layer ``layouts`` compiles for ``targets``.

    The device size in every layout; a production size in the scanned layout alone when
    the family has it (production trains scanned; 32 unrolled layers compile for
    minutes), else in its first. ``placed`` moves a production size from a production
    target to another (``--tpu default``'s, to where the family's ``Topologies`` puts it).
    """
    placed = placed or {}
    found = []
    for target in targets:
        for size in target.sizes(sizes):
            kept, where = layouts, target
            if target.production:
                kept = (True,) if True in layouts else layouts[:1]
                where = placed.get(target, {}).get(size, target)
            found += [TpuCompile(where, size, scan) for scan in kept]
    return list(dict.fromkeys(found))


def production_target(text: str) -> TpuTarget:
    """The production target a family places a size on: ``GEN:AxB[xC][=MESH]``.

    :class:`TopologyError` quoting ``text`` if it names none.
    """
    name, _, mesh = text.partition("=")
    if "@" in name:
        raise TopologyError(f"TPU slice {text!r}: a placed slice takes no '@'")
    return TpuTarget._of(text, name, mesh, True)


def libtpu_version() -> str | None:
    """The installed libtpu's version, or ``None`` when the ``tpu`` extra is missing."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_libtpu() -> str:
    """The installed libtpu's version; :class:`TopologyError` naming :data:`SETUP` if none."""
    version = libtpu_version()
    if version is None:
        raise TopologyError(f"--tpu needs libtpu, which is not installed: run {SETUP}")
    return version


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Hold back what native code writes to stderr; yield the lines once it is done."""
    lines: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines.extend(held.read().decode(errors="replace").splitlines())


NOISE: list[str] = []
"""What libtpu wrote to stderr while it described the slices (worker hostnames, MDS):
the run's header summarises it in one line."""


@functools.cache
def slice_devices(name: str) -> tuple[Any, ...]:
    """The devices of the TPU slice ``name``, compile-only, from libtpu (once per slice).

    libtpu's start-up warnings go to :data:`NOISE`, not the terminal.
    """
    require_libtpu()
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    with _quiet_stderr() as noise:
        try:
            description = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as err:
            raise TopologyError(f"libtpu cannot describe TPU topology {name!r}: {err}") from None
    NOISE.extend(line for line in noise if line.strip())
    return tuple(description.devices)
