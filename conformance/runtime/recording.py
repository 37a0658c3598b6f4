"""Recording a reference: what one live backend computes for a family, as host arrays.

:func:`record` runs one side of the family's device size and preferred layer layout on
one device (a reference must not depend on the mesh it was made on) and keeps:

* ``params/<path>``: the parameters it started from (its init from seed 0) and
  ``batch/<field>``: the batch every number below was computed on;
* ``forward/<dtype>``: the logits in float32 and bfloat16 (widened to float32);
* ``train/<step>/loss`` and ``train/<step>/grads/<path>`` for :data:`TRAIN_STEPS`
  steps, and ``train/1/state/<path>``: the whole train state after the first step (the
  one-step checkpoint a later release must resume from), with each leaf's kind in the
  manifest (``state_kinds``: ``Param``, ``OptState``, or a Variable type's name);
* ``train_bfloat16/<step>/loss``, ``train_bfloat16/<step>/grads/<path>`` and
  ``train_bfloat16/1/state/<path>``: the same in bfloat16 compute (float32 parameters
  and optimizer state);
* ``decode/...``: the prompt lengths, prefill logits, each decode step's logits and
  the greedy tokens, for a family that decodes;
* ``quant/<mode>``: the quantized logits of every Qwix mode it declares, except those
  the pinned Qwix computes wrongly on this layout.

Every path is canonical (NNX's), so a reference is read by either backend through the
family's path rules. The manifest says who recorded it and with which versions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from conformance.contract import Family, quantization_modes, supports
from conformance.core.distributed import host_array
from conformance.core.environment import library_versions
from conformance.core.references import Reference
from conformance.core.sharding import MeshSpec, one_device
from conformance.core.trees import Flat
from conformance.runtime import quant
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.live import SIDES, Side
from conformance.runtime.stepping import Training

FORMAT = 1
"""The reference format's version, in every manifest."""

TRAIN_STEPS = 3
"""Train steps recorded."""

DECODE_STEPS = 8
"""Greedy decode steps recorded after prefill."""

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""Compute dtypes whose forward logits and train steps are recorded, by name."""


def train_prefix(dtype: str) -> str:
    """Where the train steps in compute dtype ``dtype`` (a name of :data:`DTYPES`) are kept."""
    return "train" if dtype == "float32" else f"train_{dtype}"


ONE_DEVICE = one_device(MeshSpec((("data", 1),)))
"""The mesh every reference is recorded on."""


def reference_case(family: Family) -> Case:
    """The case a reference of ``family`` is recorded on and replayed from."""
    return Case.of(family).on(ONE_DEVICE)


def _host(flat: Flat, prefix: str) -> dict[str, np.ndarray]:
    """``flat`` as host arrays under ``prefix/`` (bfloat16 widened to float32, exactly)."""
    found = {}
    for path, value in flat.items():
        array = host_array(value)
        if array.dtype == jnp.bfloat16:
            array = array.astype(np.float32)
        found[f"{prefix}/{path}"] = array
    return found


def _decode(side: Side, params: Flat) -> dict[str, np.ndarray]:
    generation = side.generate(params, DECODE_STEPS)
    return _host(
        {
            "lengths": generation.lengths,
            "prefill": generation.prefill_logits,
            "steps": generation.step_logits,
            "tokens": generation.tokens,
        },
        "decode",
    )


def _trained(side: Side, params: Flat, batch: Any) -> dict[str, np.ndarray]:
    """:data:`TRAIN_STEPS` steps and the state after step 1, in each compute dtype."""
    arrays = {}
    for name, dtype in DTYPES.items():
        training = Training.start(side.on(side.case.in_dtype(dtype)), params)
        prefix = train_prefix(name)
        for step in range(1, TRAIN_STEPS + 1):
            state, loss, grads = training.advance(batch)
            arrays |= _host({"loss": loss}, f"{prefix}/{step}")
            arrays |= _host(grads, f"{prefix}/{step}/grads")
            if step == 1:
                arrays |= _host(state, f"{prefix}/1/state")
    return arrays


def _quantized(side: Side, params: Flat, batch: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    case = side.case
    arrays, left_out = {}, []
    for mode in sorted(quantization_modes(case.family)):
        if (known := quant.known_failure(mode, case.scan_layers)) is not None:
            left_out.append(f"{mode}: {known.reason}")
            continue
        quantized = side.on(case.quantized(mode))
        logits = quantized.forward(quantized.runner.quantize(params), batch)[0]
        arrays |= _host({mode: logits}, "quant")
    return arrays, left_out


def record(family: Family, backend: str) -> Reference:
    """What ``backend`` computes for ``family``, recorded on one device (see the module)."""
    case = reference_case(family)
    side = SIDES[backend](case)
    params = side.init(0)
    batch = case.batch()
    arrays = _host(side.canonical(params), "params")
    arrays |= _host(dataclasses.asdict(batch), "batch")
    for name, dtype in DTYPES.items():
        arrays |= _host({name: side.on(case.in_dtype(dtype)).forward(params, batch)[0]}, "forward")
    arrays |= _trained(side, params, batch)
    if supports(family, "decode"):
        arrays |= _decode(side, params)
    quantized, left_out = _quantized(side, params, batch)
    arrays |= quantized
    manifest = {
        "format": FORMAT,
        "family": family.name,
        "size": case.size,
        "layout": case.layout,
        "backend": backend,
        "recorded_by": side.name,
        "versions": library_versions(),
        "mesh": ONE_DEVICE.id,
        "rows": BATCH_SIZE,
        "train_steps": TRAIN_STEPS,
        "decode_steps": DECODE_STEPS if supports(family, "decode") else 0,
        "not_recorded": left_out,
        "state_kinds": side.canonical(side.trainer().kinds),
        "tolerance": "compared under the harness's float32 / bfloat16 tolerance policy",
    }
    return Reference(manifest, arrays)
