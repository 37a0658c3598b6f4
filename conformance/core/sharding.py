"""Meshes, logical-axis resolution and per-leaf sharding extraction.

Linen and NNX resolve logical axis rules differently (an unknown name is ``None`` in
Linen and stays literal in NNX; on duplicate rule keys Linen takes the first, NNX the
last), so the harness never asks either backend: it reads the logical names each side
declares and resolves both through :func:`resolve_spec`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from conformance.contract import LogicalRules
from conformance.core.trees import LeafSpec, flatten, flatten_state

Logical = tuple[str | None, ...] | None
"""Logical axis names of one leaf, one per dimension; ``None`` if the leaf has none."""

MESH_AXES = ("data", "fsdp", "tensor")
"""Axis names, in order, of the ``DxFxT`` shorthand."""

MESH_FORMS = (
    "'axis=N[,axis=N...]' (e.g. 'fsdp=8' or 'data=2,fsdp=2,tensor=2'), "
    "'DxFxT' for data x fsdp x tensor (e.g. '2x2x2'), or a mesh id (e.g. 'data2-fsdp2-tensor2')"
)


class MeshSpecError(ValueError):
    """A mesh spec string is malformed."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A named mesh shape such as ``data=2, fsdp=2, tensor=2`` (id ``data2-fsdp2-tensor2``)."""

    axes: tuple[tuple[str, int], ...]

    @property
    def id(self) -> str:
        """Readable id used in test ids and golden file names."""
        return "-".join(f"{name}{size}" for name, size in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        """Mesh axis names, in order."""
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh axis sizes, in order."""
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        """Number of devices the mesh needs."""
        return math.prod(self.shape)

    def sizes(self) -> dict[str, int]:
        """``{axis name: size}``."""
        return dict(self.axes)

    def abstract(self) -> AbstractMesh:
        """An ``AbstractMesh`` of this shape: shardings without devices."""
        return AbstractMesh(self.shape, self.names, axis_types=(AxisType.Auto,) * len(self.axes))

    def devices(self) -> Mesh:
        """A device mesh of this shape with Auto axes.

        With one process it takes the first ``size`` devices. With several, it takes an
        equal share of each process's devices, in process order (so the first mesh axis
        crosses processes, as data parallelism does on a pod); a mesh the processes
        cannot share equally but one process can hold (a one-device reference) is
        built by every process on its own devices, and each computes the same alone.
        Raises :class:`InsufficientDevices` if there are too few devices.
        """
        available = jax.devices()
        if len(available) < self.size:
            raise InsufficientDevices(
                f"mesh {self.id} needs {self.size} devices; {len(available)} "
                f"{available[0].platform} device(s) available"
            )
        processes = jax.process_count()
        if self.size % processes == 0:
            share = self.size // processes
            chosen = [
                device
                for process in range(processes)
                for device in [d for d in available if d.process_index == process][:share]
            ]
        elif self.size <= jax.local_device_count():
            chosen = jax.local_devices()[: self.size]
        else:
            raise InsufficientDevices(
                f"mesh {self.id} needs {self.size} devices, which {processes} processes "
                "cannot contribute in equal shares"
            )
        return jax.make_mesh(
            self.shape,
            self.names,
            axis_types=(AxisType.Auto,) * len(self.axes),
            devices=chosen,
        )

    def __str__(self) -> str:
        return self.id


def explicit(mesh: Mesh) -> Mesh:
    """``mesh``'s devices and axis names with every axis explicit (jax's explicit sharding).

    Arrays placed on it carry their sharding in their type, and operations whose result's
    sharding is ambiguous fail when traced instead of leaving it to the compiler.
    """
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * mesh.devices.ndim)


def moved_to(tree: Any, mesh: Mesh) -> Any:
    """``tree`` with each array on another mesh of ``mesh``'s devices moved to ``mesh``.

    Laid out alike (the same ``PartitionSpec``): for a mesh of other axis types. An array
    on other devices is left as it is, for the program to refuse; ``tree`` itself when
    nothing moves; a flax module in it is left whole.
    """
    devices = tuple(mesh.devices.flat)

    def elsewhere(leaf: Any) -> bool:
        sharding = getattr(leaf, "sharding", None)
        return (
            isinstance(sharding, NamedSharding)
            and sharding.mesh != mesh
            and tuple(sharding.mesh.devices.flat) == devices
        )

    def moved(leaf: Any) -> Any:
        if not elsewhere(leaf):
            return leaf
        return jax.device_put(leaf, NamedSharding(mesh, leaf.sharding.spec))

    def module(x: Any) -> bool:
        return isinstance(x, nnx.Module)

    if not any(elsewhere(leaf) for leaf in jax.tree.leaves(tree, is_leaf=module)):
        return tree
    return jax.tree.map(moved, tree, is_leaf=module)


def explicit_mode() -> bool:
    """Whether the mesh in context (``jax.set_mesh``) has an explicit axis."""
    return AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types


def one_device(mesh: MeshSpec) -> MeshSpec:
    """The one-device counterpart of ``mesh``: its axes (and the default ones) at size 1.

    Every logical rule still names an existing axis, and every default mesh shares one
    counterpart, so a reference computed for one mesh serves the others.
    """
    names = dict.fromkeys((*MESH_AXES, *mesh.names))
    return MeshSpec(tuple((name, 1) for name in names))


class InsufficientDevices(RuntimeError):
    """The mesh needs more devices than this process has."""


_PAIR = re.compile(r"^([A-Za-z_]\w*)=([1-9]\d*)$")
_ID_PART = re.compile(r"^([A-Za-z_]+)([1-9]\d*)$")
_SHORTHAND = re.compile(r"^[1-9]\d*(x[1-9]\d*){2}$")


def parse_mesh(text: str) -> MeshSpec:
    """Parse a mesh spec; a :class:`MeshSpecError` names the valid forms."""
    text = text.strip()
    if _SHORTHAND.match(text):
        axes = tuple(zip(MESH_AXES, (int(n) for n in text.split("x")), strict=True))
    elif "=" in text:
        matches = [_PAIR.match(part.strip()) for part in text.split(",")]
        if not all(matches):
            raise MeshSpecError(f"malformed mesh spec {text!r}; use {MESH_FORMS}")
        axes = tuple((m.group(1), int(m.group(2))) for m in matches if m)
    else:
        matches = [_ID_PART.match(part) for part in text.split("-")]
        if not text or not all(matches):
            raise MeshSpecError(f"malformed mesh spec {text!r}; use {MESH_FORMS}")
        axes = tuple((m.group(1), int(m.group(2))) for m in matches if m)
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise MeshSpecError(f"mesh spec {text!r} names an axis twice; use {MESH_FORMS}")
    return MeshSpec(axes)


class UnknownLogicalAxis(KeyError):
    """A leaf names a logical axis that no rule resolves."""


def resolve_spec(logical: Logical, rules: LogicalRules, mesh: MeshSpec) -> PartitionSpec:
    """Resolve one leaf's logical axis names to a ``PartitionSpec`` on ``mesh``.

    For each dimension the first rule for its name wins; mesh axes the mesh lacks are
    dropped, and a mesh axis already used by an earlier dimension is not used again, so
    the spec is always valid. A name with no rule raises :class:`UnknownLogicalAxis`.
    """
    if logical is None:
        return PartitionSpec()
    table: dict[str, Any] = {}
    for name, target in rules:
        table.setdefault(name, target)
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for name in logical:
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise UnknownLogicalAxis(name)
        target = table[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        kept = tuple(a for a in targets if a in mesh.names and a not in used)
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


class LogicalRankError(ValueError):
    """Leaves that declare a different number of logical axis names than they have dimensions.

    ``jax`` pads a short ``PartitionSpec`` with ``None``, so such a leaf would be placed
    on the wrong dimensions without a word: for example a stacked layer whose logical
    names lost the ``layers`` axis its layer transform adds.
    """

    def __init__(self, leaves: list[str]) -> None:
        self.leaves = tuple(leaves)
        """One line per leaf: its path, shape and logical names."""
        super().__init__(
            f"{len(leaves)} leaf(s) with a logical axis name per dimension too few or too "
            "many (a layer transform, nn.scan, nnx.vmap or nnx.scan, may not have added its "
            "axis name): " + "; ".join(leaves)
        )


def ranked(logical: Mapping[str, Logical], specs: Mapping[str, LeafSpec]) -> dict[str, Logical]:
    """``logical``, checked to name every dimension of its leaf in ``specs`` (by path).

    A leaf with too few or too many names raises :class:`LogicalRankError`, naming each.
    """
    wrong = [
        f"{path}: shape {tuple(specs[path].shape)}, logical names {names}"
        for path, names in logical.items()
        if names is not None and len(names) != len(specs[path].shape)
    ]
    if wrong:
        raise LogicalRankError(wrong)
    return dict(logical)


def linen_logical(variables: Any) -> dict[str, Logical]:
    """``{path: logical names}`` for a Linen collection of boxed (or plain) leaves."""
    flat = flatten(variables, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    return {
        path: tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else None
        for path, leaf in flat.items()
    }


def nnx_logical(state: nnx.State) -> dict[str, Logical]:
    """``{path: logical names}`` from the ``out_sharding`` metadata of NNX Variables."""
    result: dict[str, Logical] = {}
    for path, var in flatten_state(state).items():
        names = var.get_metadata().get("out_sharding")
        result[path] = None if names is None else tuple(names)
    return result


def spec_to_json(spec: PartitionSpec, ndim: int) -> list[Any]:
    """A ``PartitionSpec`` as a plain list of length ``ndim`` (``None``, a name, or names)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def indivisible(
    shape: Sequence[int], spec: PartitionSpec, mesh: MeshSpec
) -> list[tuple[int, int, int]]:
    """Dimensions that the spec shards unevenly: ``(dim, size, shards)`` for each."""
    sizes = mesh.sizes()
    bad = []
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        shards = math.prod(sizes[a] for a in axes)
        if shape[dim] % shards:
            bad.append((dim, int(shape[dim]), shards))
    return bad
