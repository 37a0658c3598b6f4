"""Leaf transforms: path rules that change a leaf's layout as well as its name.

A family's :meth:`~conformance.contract.Family.path_rules` take each Linen parameter to
its canonical (NNX) path. Most rules rename, ``(pattern, replacement)``. When the two
backends hold a parameter in different layouts, a rule also says how its values move:

- :class:`Split`: one Linen leaf whose slices along an axis are several NNX leaves;
- :class:`Stack`: several Linen leaves stacked on a new axis are one NNX leaf;
- :class:`Transpose`: the axes of one leaf permuted;
- :class:`Reshape`: one leaf given another shape of the same size.

Each is invertible, so conversion runs both ways. Every rule, rename or transform, is
matched with ``re.search`` against Linen paths and rewrites with ``re.sub(count=1)``;
rules are tried in order and the first whose pattern matches a path takes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def _as_tuple(rule: Any, field: str) -> None:
    """Hold ``rule``'s ``field`` as a tuple, however given (a rule is hashable)."""
    object.__setattr__(rule, field, tuple(getattr(rule, field)))


@dataclasses.dataclass(frozen=True)
class Split:
    """A Linen leaf matching ``pattern`` is the NNX leaves ``into``, sliced along ``axis``.

    ``into`` holds one replacement per slice, in order; the axis is dropped, so a Linen
    ``[2, D, H]`` kernel becomes two ``[D, H]`` NNX kernels. Its inverse is :class:`Stack`.
    """

    pattern: str
    into: tuple[str, ...]
    axis: int = 0

    def __post_init__(self) -> None:
        _as_tuple(self, "into")


@dataclasses.dataclass(frozen=True)
class Stack:
    """Linen leaves matching each of ``parts``, stacked on a new ``axis``, are one NNX leaf.

    ``parts`` holds one pattern per slice, in order; each pattern's match is rewritten
    by ``into``, and the leaves rewritten to the same NNX path are stacked. Every NNX
    leaf must get exactly one Linen leaf from each part. Its inverse is :class:`Split`.
    """

    parts: tuple[str, ...]
    into: str
    axis: int = 0

    def __post_init__(self) -> None:
        _as_tuple(self, "parts")


@dataclasses.dataclass(frozen=True)
class Transpose:
    """A Linen leaf matching ``pattern`` is the NNX leaf ``into`` with axes ``perm``.

    The NNX leaf's axis ``i`` is the Linen leaf's axis ``perm[i]`` (as ``np.transpose``).
    """

    pattern: str
    into: str
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _as_tuple(self, "perm")


@dataclasses.dataclass(frozen=True)
class Reshape:
    """A Linen leaf matching ``pattern`` is the NNX leaf ``into``, of shape ``shape``.

    ``shape`` may hold one ``-1`` (as ``np.reshape``). Logical axis names carry over
    only where dimensions split or merge whole (``[D, H*K]`` and ``[D, H, K]``): a split
    dimension's name goes to its major part, and merged dimensions keep the major one's.
    """

    pattern: str
    into: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _as_tuple(self, "shape")


LeafTransform = Split | Stack | Transpose | Reshape
"""A path rule that changes a leaf's layout as well as its name."""
