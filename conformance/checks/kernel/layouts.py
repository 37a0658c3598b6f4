"""Leaves compared: the parameter map between two sides, placements, specs, round trips.

Every pair of sides shares parameters in canonical paths and layouts, checked to meet
one-to-one (:func:`paired`); specs are resolved and compared per leaf (:func:`agreed_specs`), arrays
checked to be placed as asked (:func:`misplaced`), and a tree saved and restored with
orbax to come back exactly (:func:`round_trip`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from conformance.contract import Backend, LogicalRules
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import EXACT, compare_trees
from conformance.core.records import failed
from conformance.core.sharding import Logical, indivisible, spec_to_json
from conformance.core.trees import Flat, LeafSpec, PathMapError, structure_diff
from conformance.runtime.checkpoints import CheckpointError, CheckpointInfo, restore, save
from conformance.runtime.sides import Side


def paired(first: Side, second: Side) -> None:
    """Both sides' parameters meet one-to-one in canonical paths (else a failure).

    Each of ``first``'s parameters (or each slice of one a leaf transform splits) must
    land on exactly one of ``second``'s canonical parameters, and every one of those must
    be reached. Between sides whose paths need no rules (two modes of NNX), a failure
    lists the parameters one side has and the other lacks, as ``structure`` does.
    """
    try:
        first.leaf_map().check_covers(
            second.canonical(second.runner.specs), first.runner.specs, (first.name, second.name)
        )
    except PathMapError as err:
        if not first.path_rules():
            fail_if_any(
                f"{first.name} and {second.name} hold different parameters",
                structure_problems(
                    (first, first.runner.specs, first.runner.held),
                    (second, second.runner.specs, second.runner.held),
                ),
            )
        fail(str(err))


HELD_INSTEAD = {Backend.LINEN: "in {}, not 'params'", Backend.NNX: "as {}, not nnx.Param"}
"""How a side of each backend holds a value outside its parameters, in words."""


def structure_problems(
    first: tuple[Side, Mapping[str, LeafSpec], Mapping[str, str]],
    second: tuple[Side, Mapping[str, LeafSpec], Mapping[str, str]],
) -> list[str]:
    """Every leaf of the two sides' trees that differs, one line each, by canonical path.

    Each side is given as ``(side, leaves, held)``: its tree in its own paths, and what
    it holds outside that tree (a Linen collection, an NNX Variable type) at canonical
    paths (see :func:`~conformance.core.trees.structure_diff`). ``first``'s leaves move
    to canonical paths and layouts first, and are named by their own paths.
    """
    (side, specs, held), (other, other_specs, other_held) = first, second
    origins = side.leaf_map().origins()
    moved = {origins.get(p, p): spec for p, spec in side.canonical(specs).items()}
    mapping = {origin: path for path, origin in origins.items()}

    def worded(by: Side, kinds: Mapping[str, str]) -> dict[str, str]:
        return {path: HELD_INSTEAD[by.backend].format(kind) for path, kind in kinds.items()}

    return structure_diff(
        moved,
        other.canonical(other_specs),
        mapping,
        worded(side, held),
        worded(other, other_held),
        (side.name, other.name),
    )


def shared_params(first: Side, second: Side, start: Flat | None = None) -> tuple[Flat, Flat]:
    """``first``'s parameters and the same values on ``second``, both on the devices.

    ``first``'s are its init from seed 0, or ``start`` (its own paths) when given; the
    path map between the two is checked to be a bijection first.
    """
    paired(first, second)
    params = first.init(0) if start is None else first.place(start)
    return params, second.receive(params, first)


def misplaced(arrays: Mapping[str, Any], shardings: Mapping[str, Any]) -> list[str]:
    """Arrays not placed as ``shardings`` asks, one line each: path, expected, actual."""
    return [
        f"{path}: expected {shardings[path].spec}, placed as {value.sharding}"
        for path, value in sorted(arrays.items())
        if not value.sharding.is_equivalent_to(shardings[path], value.ndim)
    ]


def agreed_specs(
    first: tuple[Side, Mapping[str, Logical], Mapping[str, LeafSpec]],
    second: tuple[Side, Mapping[str, Logical], Mapping[str, LeafSpec]],
    mapping: Mapping[str, str] | None = None,
    rules: LogicalRules | None = None,
) -> tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]]:
    """Both sides' leaves resolved on the case's mesh: equal per leaf and evenly split.

    Each side is given as ``(side, logical names, shapes)`` of the leaves compared
    (parameters, caches, frozen kernels), ``mapping`` takes the first's paths to the
    second's (default: both in canonical paths, every one of the second's paths its
    own), and ``rules`` default to the config's :meth:`Family.axis_rules`. Fails listing
    every leaf that differs or splits unevenly; returns each side's specs.
    """
    (a, a_logical, _), (b, b_logical, b_shapes) = first, second
    mapping = {path: path for path in b_shapes} if mapping is None else mapping
    mesh = b.case.mesh
    a_specs, b_specs = a.case.specs(a_logical, rules), b.case.specs(b_logical, rules)
    problems = []
    for src, dst in sorted(mapping.items(), key=lambda kv: kv[1]):
        if a_specs[src] != b_specs[dst]:
            problems.append(
                f"{dst}: {a.name} {a_specs[src]} (logical {a_logical[src]}) != "
                f"{b.name} {b_specs[dst]} (logical {b_logical[dst]})"
            )
        for dim, size, shards in indivisible(b_shapes[dst].shape, b_specs[dst], mesh):
            problems.append(
                f"{dst}: dim {dim} of size {size} is split {shards} ways by "
                f"{b_specs[dst]} on mesh {mesh.id}: not divisible"
            )
    fail_if_any(f"{len(problems)} problem(s) on mesh {mesh.id}", problems)
    return a_specs, b_specs


def leaf_table(
    specs: Mapping[str, LeafSpec], resolved: Mapping[str, PartitionSpec]
) -> dict[str, dict[str, Any]]:
    """``{path: {"shape", "dtype", "spec"}}`` for every leaf, sorted by path (a golden's body)."""
    return {
        path: {
            "shape": list(spec.shape),
            "dtype": spec.dtype,
            "spec": spec_to_json(resolved[path], len(spec.shape)),
        }
        for path, spec in sorted(specs.items())
    }


def round_trip(
    side: Side, tree: Flat, layout: Mapping[str, LeafSpec], directory: Path, what: str
) -> Flat:
    """``tree`` saved with orbax to ``directory`` and restored strictly into ``layout``.

    The checkpoint records the side's case (family, size, backend, layer layout); every
    leaf is restored with the sharding it was saved with. A refused restore fails
    naming ``what``, and so does a leaf that does not come back exactly.
    """
    case = side.case
    info = CheckpointInfo(case.family.name, case.size, side.backend, case.scan_layers)
    save(directory, tree, info)
    try:
        restored = restore(directory, layout, {p: v.sharding for p, v in tree.items()})
    except CheckpointError as err:
        fail(f"{what}: {err}")
    mismatches = compare_trees(tree, restored, EXACT)
    if mismatches:
        fail(failed(f"{what} after an orbax round trip", mismatches, ("saved", "restored")))
    return restored
