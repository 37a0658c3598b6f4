"""The contract between the harness and a model zoo: families, their registry, validation.

Nothing here imports another harness module; everything else builds on it.
"""

from conformance.contract.family import (
    Batch,
    Capabilities,
    Family,
    FamilyError,
    LogicalRules,
    PathRules,
    QuantScope,
)
from conformance.contract.registry import (
    DISTRIBUTION,
    ENTRY_POINT_GROUP,
    builtin,
    get,
    registry,
    select,
)

__all__ = [
    "DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "Batch",
    "Capabilities",
    "Family",
    "FamilyError",
    "LogicalRules",
    "PathRules",
    "QuantScope",
    "builtin",
    "get",
    "registry",
    "select",
]
