"""Sides: the implementations of a case that the checks compare, and the pair they compare.

A :class:`Side` is one implementation of a :class:`~conformance.runtime.case.Case`'s
model on the case's mesh (:mod:`conformance.runtime.live`): Linen, NNX, or the NNX model
in a mode (:mod:`conformance.runtime.modes`). A check asks :func:`live_pair` for the
two sides of its case's :class:`~conformance.contract.Pair` (Linen against NNX, graph
against tree mode, auto against explicit axes) and compares what it gets: the modes
are sides, never branches in a check.
"""

from __future__ import annotations

from conformance.contract import Pair
from conformance.runtime.case import Case
from conformance.runtime.decoding import Decoder
from conformance.runtime.live import SIDES, LinenSide, NnxSide, Side, Trainer
from conformance.runtime.modes import NnxAutoSide, NnxExplicitSide, NnxGraphSide, NnxTreeSide

__all__ = [
    "SIDES",
    "Decoder",
    "LinenSide",
    "NnxSide",
    "Side",
    "Trainer",
    "live_pair",
    "live_sides",
]


def live_pair(case: Case) -> tuple[Side, Side]:
    """The pair every two-sided check compares on ``case``: ``(Linen, NNX)`` by default.

    For a mode pair, the NNX model in flax's graph mode and in tree mode, or on auto
    and on explicit mesh axes: each side named by its mode.
    """
    match case.pair:
        case Pair.GRAPH_TREE:
            return NnxGraphSide(case), NnxTreeSide.of(case)
        case Pair.AUTO_EXPLICIT:
            return NnxAutoSide(case), NnxExplicitSide.of(case)
        case _:
            return LinenSide(case), NnxSide(case)


def live_sides(case: Case) -> tuple[Side, ...]:
    """The live sides of ``case``: its pair, or NNX alone when Linen was deleted."""
    if case.pair is Pair.LINEN_NNX and not case.family.has_linen:
        return (NnxSide(case),)
    return live_pair(case)
