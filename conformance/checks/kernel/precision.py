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
    linen: Side,
    nnx_: Side,
    batch: Batch,
    rules: PathRules,
    accepted: Sequence[PrecisionChange] = (),
) -> tuple[list[PrecisionDifference], list[PrecisionChange]]:
    """Paired modules whose forward computes, takes or returns other dtypes per side.

    Returns the differences no ``accepted`` change covers, and the accepted changes that
    cover none. ``rules`` are the family's path rules, which pair modules holding no
    parameters.
    """
    first, second = profile(linen.runner, batch), profile(nnx_.runner, batch)
    pairs = module_pairs(
        linen.leaf_map().pairs(),
        rules,
        sorted({path for path, _ in first.boundary}),
        sorted({path for path, _ in second.boundary}),
    )
    return unmatched(compare_profiles(first, second, pairs), accepted)
