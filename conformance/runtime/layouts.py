"""How one layer layout's leaves stack into the other's, in canonical (NNX) paths.

A :class:`Stacking` holds ``{scanned path: per-layer paths in layer order}`` tables for
:func:`conformance.core.trees.restack`, for the parameters and for the family's
persistent state. A family's :class:`~conformance.contract.Layouts` states its stack
rules in canonical paths, applied here to the NNX model's leaves, so they hold once Linen
is deleted. A first-edition family's ``layer_stack_rules`` are in Linen paths: they are
applied to the Linen model's leaves, and each path is then mapped to canonical by the
family's path rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conformance.contract import Family, Layouts, declared, persistent_types
from conformance.core.trees import PathMapError, layer_table
from conformance.runtime.backends import (
    LinenRunner,
    linen_runner,
    nnx_runner,
    persistent_collections,
)
from conformance.runtime.paths import canonical_paths

Table = dict[str, list[str]]
"""``{scanned path: per-layer paths in layer order}``."""


@dataclasses.dataclass(frozen=True)
class Stacking:
    """The stack tables of one family and size, with the axes their leaves stack on."""

    params: Table
    """Parameters (and the optimizer moments mirroring them), stacked on :attr:`axis`."""
    state: Table
    """Persistent state (:class:`~conformance.contract.PersistentState`), stacked
    on :attr:`state_axis`."""
    axis: int
    state_axis: int


def stacking(family: Family, loop_config: Any, scan_config: Any) -> Stacking:
    """How ``loop_config``'s layers stack into ``scan_config``'s, in canonical paths.

    Empty tables when the family states no stack rules.
    """
    feature = declared(family, Layouts)
    axes = (0, 0) if feature is None else (feature.axis, feature.state_axis)
    if feature is not None and feature.stack is not None:
        rules, model = feature.stack(loop_config), nnx_runner(family, loop_config)
        kinds = {f"{kind.__module__}.{kind.__qualname__}" for kind in persistent_types(family)}
        state = [path for path, kind in model.held.items() if kind in kinds]
        return Stacking(layer_table(rules, model.specs), layer_table(rules, state), *axes)
    rules, linen = family.layer_stack_rules(loop_config), linen_runner(family, loop_config)
    loop, scan = canonical_paths(family, loop_config), canonical_paths(family, scan_config)
    tables = (layer_table(rules, linen.specs), layer_table(rules, _persistent(family, linen)))
    moved = sorted(
        p for table in tables for layers in table.values() for p in layers if p not in loop
    )
    if moved:
        raise PathMapError(
            f"{family.name}'s layer_stack_rules (Linen paths) take {moved[0]}, which a leaf "
            "transform moves: state them in canonical paths, Layouts(stack=...)"
        )
    params, state = (
        {scan.get(s, s): [loop.get(p, p) for p in layers] for s, layers in table.items()}
        for table in tables
    )
    return Stacking(params, state, *axes)


def _persistent(family: Family, linen: LinenRunner) -> list[str]:
    """The paths of ``linen``'s persistent state, within their collections."""
    return [path for c in persistent_collections(family) for path in linen.kept.get(c, {})]
