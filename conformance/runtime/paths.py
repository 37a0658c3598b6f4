"""A family's path rules bound to its Linen model: the leaf map of one config.

The map takes the Linen model's parameters and the state kept beside them (persistent
state, the ``_overwrite_with_gradient`` collection) to canonical (NNX) paths and
layouts; see :mod:`conformance.core.leafmap`.
"""

from __future__ import annotations

from typing import Any

from conformance.contract import Family
from conformance.core.leafmap import LeafMap, build
from conformance.core.scope import scoped
from conformance.runtime.backends import LinenRunner, linen_runner, nnx_runner


@scoped
def linen_leaf_map(family: Family, config: Any, runner: LinenRunner | None = None) -> LeafMap:
    """The leaf map of ``config``'s Linen model (``runner``, by default the float one).

    Raises :class:`~conformance.core.trees.PathMapError` when a rule does not fit its
    leaves or two leaves land on one path. Built once per scope.
    """
    linen = runner or linen_runner(family, config)
    leaves = (linen.specs, *linen.kept.values())
    return build(family.path_rules(config), {p: s.shape for at in leaves for p, s in at.items()})


def checked_leaf_map(family: Family, config: Any) -> LeafMap:
    """:func:`linen_leaf_map`, its parameters checked to land on NNX's exactly.

    Raises :class:`~conformance.core.trees.PathMapError` listing every leaf that does not.
    """
    linen = linen_runner(family, config)
    leaf_map = linen_leaf_map(family, config, linen)
    leaf_map.check_covers(nnx_runner(family, config).specs, linen.specs)
    return leaf_map


def canonical_paths(family: Family, config: Any) -> dict[str, str]:
    """``{Linen path: canonical path}`` of ``config``'s leaves that move by name alone.

    The parameters' map is checked first (:func:`checked_leaf_map`).
    """
    moves = checked_leaf_map(family, config).moves
    return {m.sources[0]: m.targets[0] for m in moves if len(m.sources) == len(m.targets) == 1}
