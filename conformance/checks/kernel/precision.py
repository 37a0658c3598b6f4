"""Precision profiles compared: which dtypes each module of a forward computes in, per side.

Both forwards are traced, never compiled or run (:mod:`conformance.runtime.precision`),
and their modules paired as localisation pairs them, so a precision change is named
before, and apart from, any number it moves.
"""

from __future__ import annotations

from typing import Any

import jax

from conformance.contract import PathRules
from conformance.runtime.diagnose.localise import module_pairs
from conformance.runtime.precision import (
    PrecisionDifference,
    compare_profiles,
    profile,
)
from conformance.runtime.sides import Side


def _abstract(side: Side) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        path: jax.ShapeDtypeStruct(spec.shape, spec.dtype)
        for path, spec in side.runner.specs.items()
    }


def precision_differences(
    linen: Side, nnx_: Side, batch: Any, rules: PathRules
) -> list[PrecisionDifference]:
    """Every paired module whose forward computes, takes or returns other dtypes per side.

    ``rules`` are the family's path rules, which pair modules holding no parameters.
    """
    first = profile(linen.runner, _abstract(linen), batch)
    second = profile(nnx_.runner, _abstract(nnx_), batch)
    pairs = module_pairs(
        linen.leaf_map().pairs(),
        rules,
        sorted({path for path, _ in first.boundary}),
        sorted({path for path, _ in second.boundary}),
    )
    return compare_profiles(first, second, pairs)
