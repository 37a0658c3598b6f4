"""Which precision each module computes in, per side, and the two sides compared.

:mod:`~conformance.runtime.precision.profile` traces one side's forward into a profile;
:mod:`~conformance.runtime.precision.compare` names the modules whose profiles differ.
"""

from conformance.runtime.precision.compare import (
    BoundaryRow,
    GroupRow,
    PrecisionDifference,
    Row,
    compare_profiles,
    unmatched,
)
from conformance.runtime.precision.profile import (
    PRIMITIVES,
    ROUNDING,
    SUM_OF_PRODUCTS,
    Profile,
    profile,
    within,
)

__all__ = [
    "PRIMITIVES",
    "ROUNDING",
    "SUM_OF_PRODUCTS",
    "BoundaryRow",
    "GroupRow",
    "PrecisionDifference",
    "Profile",
    "Row",
    "compare_profiles",
    "profile",
    "unmatched",
    "within",
]
