"""The table of every built-in check: what each area module declares, in area order."""

from __future__ import annotations

from conformance.checks import (
    activations,
    aqt,
    checkpoint,
    cost,
    decode,
    forward,
    invariance,
    modes,
    precision,
    quantization,
    recorded,
    state,
    structure,
    tpu,
    training,
)
from conformance.checks.declare import Check, declared

AREAS = (
    activations,
    aqt,
    checkpoint,
    cost,
    tpu,
    decode,
    forward,
    precision,
    structure,
    quantization,
    recorded,
    invariance,
    state,
    training,
    modes,
)
"""The area modules whose declared checks the harness ships."""

BUILTIN: dict[str, Check] = {check.name: check for area in AREAS for check in declared(area)}
"""The checks this package ships, by name."""
