"""The contract between the harness and a model zoo: families, their registry, validation.

Nothing here imports another harness module; everything else builds on it.
"""

from conformance.contract.declared import (
    declared,
    first_edition_features,
    quantization_modes,
    quantization_scope,
    required,
    spelling,
    supports,
)
from conformance.contract.discovery import (
    DISTRIBUTION,
    ENTRY_POINT_GROUP,
    builtin,
    get,
    registry,
    select,
)
from conformance.contract.family import Family
from conformance.contract.features import (
    Aqt,
    CacheAsValue,
    Decode,
    Dropout,
    Feature,
    Fp8,
    Qwix,
    Remat,
    VocabTiling,
)
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
    "Aqt",
    "Backend",
    "Batch",
    "CacheAsValue",
    "Capabilities",
    "Decode",
    "Divergence",
    "Dropout",
    "Family",
    "FamilyError",
    "Feature",
    "FirstEditionKey",
    "FirstEditionWarning",
    "Fp8",
    "LogicalRules",
    "DECODE_STYLES",
    "PREDICTIONS",
    "QUANTIZATION_MODES",
    "PathRules",
    "QuantScope",
    "Qwix",
    "Remat",
    "VocabTiling",
    "builtin",
    "declared",
    "divergences",
    "first_edition_features",
    "get",
    "problems",
    "quantization_modes",
    "quantization_scope",
    "registry",
    "required",
    "select",
    "spelling",
    "supports",
    "validate",
]
