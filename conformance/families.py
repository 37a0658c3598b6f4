"""The public face for model zoos: the Family contract and the family registry.

A zoo writes its families against these names (``from conformance.families import
Family, Capabilities, Decode, Batch, QuantScope``) and registers them under the
``conformance.families`` entry point group; :mod:`conformance.contract` holds them.
"""

from conformance.contract import (
    DECODE_STYLES,
    DISTRIBUTION,
    ENTRY_POINT_GROUP,
    PREDICTIONS,
    QUANTIZATION_MODES,
    Aqt,
    Batch,
    CacheAsValue,
    Capabilities,
    Decode,
    Divergence,
    Dropout,
    Family,
    FamilyError,
    Feature,
    FirstEditionWarning,
    Fp8,
    LogicalRules,
    PathRules,
    QuantScope,
    Remat,
    VocabTiling,
    builtin,
    get,
    registry,
    select,
)

__all__ = [
    "DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "Aqt",
    "Batch",
    "CacheAsValue",
    "Capabilities",
    "Decode",
    "Divergence",
    "Dropout",
    "Family",
    "FamilyError",
    "Feature",
    "FirstEditionWarning",
    "Fp8",
    "LogicalRules",
    "DECODE_STYLES",
    "PREDICTIONS",
    "QUANTIZATION_MODES",
    "PathRules",
    "QuantScope",
    "Remat",
    "VocabTiling",
    "builtin",
    "get",
    "registry",
    "select",
]
