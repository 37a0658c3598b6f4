"""The contract between the harness and a model zoo: families, their registry, validation.

Nothing here imports another harness module; everything else builds on it.
"""

from conformance.contract.declared import declared, supports
from conformance.contract.discovery import (
    DISTRIBUTION,
    ENTRY_POINT_GROUP,
    builtin,
    get,
    registry,
    select,
)
from conformance.contract.family import Family
from conformance.contract.features import CacheAsValue, Decode, Feature
from conformance.contract.validate import problems, validate
from conformance.contract.values import (
    DECODE_STYLES,
    PREDICTIONS,
    QUANTIZATION_MODES,
    Backend,
    Batch,
    Capabilities,
    Divergence,
    FamilyError,
    FirstEditionKey,
    FirstEditionWarning,
    LogicalRules,
    PathRules,
    QuantScope,
    divergences,
)

__all__ = [
    "DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "Backend",
    "Batch",
    "CacheAsValue",
    "Capabilities",
    "Decode",
    "Divergence",
    "Family",
    "FamilyError",
    "Feature",
    "FirstEditionKey",
    "FirstEditionWarning",
    "LogicalRules",
    "DECODE_STYLES",
    "PREDICTIONS",
    "QUANTIZATION_MODES",
    "PathRules",
    "QuantScope",
    "builtin",
    "declared",
    "divergences",
    "get",
    "problems",
    "registry",
    "select",
    "supports",
    "validate",
]
