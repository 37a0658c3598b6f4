"""Precision profiles compared: which dtypes each module of a forward computes in, per side.

Both forwards are traced, never compiled or run (:mod:`conformance.runtime.precision`),
and their modules paired as localisation pairs them, so a precision change is named
before, and apart from, any number it moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.contract import Batch, PathRules, PrecisionChange
from conformance.runtime.diagnose.localise import module_pairs
from conformance.runtime.precision import (
    PrecisionDifference,
    compare_profiles,
    profile,
    unmatched,
)
from conformance.runtime.sides import Side


def precision_differences(
    one: Side,
    other: Side,
    batch: Batch,
    rules: PathRules,
    accepted: Sequence[PrecisionChange] = (),
) -> tuple[list[PrecisionDifference], list[PrecisionChange]]:
    """Paired modules whose forward computes, takes or returns other dtypes per side.

    Returns the differences no ``accepted`` change covers, and the accepted changes that
    cover none. ``rules`` take ``one``'s paths to ``other``'s (the family's path rules
    for Linen), which pair modules holding no parameters.
    """
    first, second = profile(one.runner, batch), profile(other.runner, batch)
    pairs = module_pairs(
        one.leaf_map().pairs(),
        rules,
        sorted({path for path, _ in first.boundary}),
        sorted({path for path, _ in second.boundary}),
    )
    return unmatched(compare_profiles(first, second, pairs), accepted)
