"""Checks against a recorded reference: a live backend against what a backend once computed.

Each check loads the family's reference recorded from one backend (a
:class:`~conformance.runtime.recorded.RecordedSide`), gives a live side its parameters
(through the family's path rules and ``upgrade_reference`` hook) and its batch, runs the
same computation as recorded, on one device, and compares the two under the tolerance
policy, reporting leaf, index and both values, and which library versions changed since
the recording.

The live side runs on one device because the recording did: a bfloat16 or quantized
result legitimately moves when partitioned (float sums reorder and cross rounding or
quantization steps), so a mesh run against a one-device recording would cry wolf.
Partitioning is what ``sharding_invariance`` and the live-pair checks gate.

A recording made on another machine rounds differently (XLA compiles for the host's
CPU), so a comparison that fails the policy is made again within the live side's own
spread: what it computes partitioned on the case's mesh
(:func:`~conformance.checks.kernel.partitioned_side`), and for quantized logits the
quantization-aware policy with the recorded float32 logits as the recording's float
twin. Only what the live side's own runs disagree about (or, quantized, what rounding
explains) passes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance.checks.declare import Axis, F, Param, declare
from conformance.checks.kernel import (
    against_title,
    beyond_own_spread,
    beyond_spread_note,
    fail_against,
    partitioned_side,
    persistent_state,
    quantized_forwards,
    recorded_pair,
    recorded_params,
    recorded_step_parity,
    require_training,
    without_training,
)
from conformance.contract import preferred_layout
from conformance.core.distributed import host_array
from conformance.core.failure import KnownFailure, fail, fail_if_any
from conformance.core.numerics import compare_arrays, compare_trees, report, tolerance_for
from conformance.core.records import emit_verdict
from conformance.core.rounding import RECORDED_ERROR_SPREAD
from conformance.core.trees import Flat, specs
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.checkpoints import CheckpointError, cast_counters
from conformance.runtime.generation import prompt_only
from conformance.runtime.quant import known_failure as quant_failure
from conformance.runtime.recorded import RecordedSide
from conformance.runtime.recording import DTYPES
from conformance.runtime.sides import SIDES, Side
from conformance.runtime.stepping import Training
from conformance.runtime.train_state import flat_state

_LIVE = (("backend", tuple(Param(f"live-{backend}", backend) for backend in SIDES)),)
"""Each live backend, against the recorded one."""


def _against_recorded(
    axes: tuple[Axis, ...] = (Axis.FAMILY, Axis.RECORDED),
    capability: str | None = None,
    known_failure: Callable[[Mapping[str, Any]], KnownFailure | None] | None = None,
) -> Callable[[F], F]:
    """Declare a check of each live backend against a recorded reference, on the primary mesh."""
    return declare(
        axes,
        _LIVE,
        where="primary",
        capability=capability,
        pair=False,
        references=True,
        known_failure=known_failure,
    )


def _known_qwix_failure(values: Mapping[str, Any]) -> KnownFailure | None:
    """A mode the pinned Qwix computes wrongly in the layout references are recorded in.

    The recorder leaves those logits out (its manifest's ``not_recorded`` says why), so
    the check fails finding none.
    """
    if values["quant"] is None:
        return None
    known = quant_failure(values["quant"], preferred_layout(values["family"]))
    if known is None:
        return None
    return dataclasses.replace(known, shows=f"holds no {re.escape(values['quant'])} logits")


@_against_recorded()
def check_recorded_forward(case: Case, backend: str, recorded: str, references: Path) -> None:
    """The live forward from the recorded parameters equals the recorded logits.

    In float32 and bfloat16; below float32, an element outside tolerance passes when the
    live side is no farther than the recording from the recorded float32 logits. Logits
    that disagree are compared again within the live side's own spread (the same forward
    partitioned on ``case``'s mesh, :func:`~conformance.checks.kernel.partitioned_side`). Below
    float32, once float32 agrees, logits still apart pass when they are finite and no
    farther from the recording in relative L2 than the live side's partitioned logits are
    from its own: rounding, which another machine's compiler does differently, moves them that much.
    """
    live, reference = recorded_pair(case, backend, recorded, references)
    params = recorded_params(live, reference)
    batch = live.case.place(reference.batch())
    wide = reference.logits("forward/float32")
    names = (reference.name, live.name)
    for name, dtype in DTYPES.items():
        side = live.on(live.case.in_dtype(dtype))
        expected = reference.logits(f"forward/{name}")
        logits = host_array(side.forward(params, batch)[0]).astype(np.float32)
        tol = tolerance_for(dtype)
        title = against_title(live, reference, f"{name} forward")
        precise = None if name == "float32" else wide
        found = compare_arrays("logits", expected, logits, tol, precise)
        partitioned = None
        if found is not None:
            other = partitioned_side(side, case)
            again = other.forward(
                recorded_params(other, reference), other.case.place(reference.batch())
            )
            partitioned = host_array(again[0]).astype(np.float32)
            found = compare_arrays("logits", expected, logits, tol, precise, partitioned)
        beyond = ""
        if found is not None and partitioned is not None and precise is not None:
            beyond = beyond_own_spread(live.name, expected, logits, partitioned, case.mesh.id)
            found = found if beyond else None
        emit_verdict(title, "logits", expected, logits, found, names=names, tolerance=tol)
        if found is not None:
            text = report(f"{title} (index: batch, position, vocab)", [found], names)
            spread = beyond_spread_note(live, case, "the same forward")
            fail_against(live, reference, f"{text}\n  {spread}{beyond}")


@_against_recorded((Axis.FAMILY, Axis.DTYPE, Axis.RECORDED))
def check_recorded_train_step(case: Case, backend: str, recorded: str, references: Path) -> None:
    """Train steps from the recorded parameters equal the recorded ones.

    Every step's loss and gradients, and after step 1 the whole state (parameters, Adam
    moments, counts, the step counter). In bfloat16 compute (float32 parameters and
    optimizer state) the loss and gradients of each step, a step beyond the bfloat16
    policy passing when it is within rounding of the recorded one.
    """
    live, reference = recorded_pair(case, backend, recorded, references)
    recorded_step_parity(
        case,
        live,
        reference,
        "train",
        lambda side: Training.start(side, recorded_params(side, reference)),
        1,
    )


def _resumed(side: Side, reference: RecordedSide) -> Training:
    """A live train state holding the recorded state after step 1.

    Every recorded leaf must have a place in the live state, and every live leaf a
    recorded value of the same shape and dtype (step counters are cast exactly between
    backends' integer types); otherwise the check fails naming them: a release that
    moved a variable out of the state would resume it from its initialiser. A parameter
    that became declared persistent state keeps its value and drops its optimizer moments.
    """
    dtype = jnp.dtype(side.case.dtype).name
    require_training(reference, dtype, state=True)
    training = Training.start(side, recorded_params(side, reference))
    live = specs(flat_state(training.state))
    recorded_state = reference.state_after_first_step(dtype)
    state = side.own(without_training(recorded_state, persistent_state(side)))
    try:
        recorded = cast_counters(state, live)
    except CheckpointError as err:
        fail(str(err))
    problems = [
        f"{p}: recorded, but the live state has no such leaf"
        for p in sorted(set(recorded) - set(live))
    ]
    problems += [
        f"{p}: in the live state, but not recorded" for p in sorted(set(live) - set(recorded))
    ]
    for path in sorted(set(live) & set(recorded)):
        want, got = live[path], recorded[path]
        if tuple(want.shape) != got.shape or want.dtype != got.dtype.name:
            recorded_as, live_as = (
                f"{got.dtype}{list(got.shape)}",
                f"{want.dtype}{list(want.shape)}",
            )
            problems.append(f"{path}: recorded {recorded_as}, live {live_as}")
    fail_if_any(f"{side.name} cannot resume from {reference.label}'s one-step state", problems)
    training.state = jax.device_put(training.trainer.tree(recorded), training.shardings)
    return training


@_against_recorded((Axis.FAMILY, Axis.DTYPE, Axis.RECORDED))
def check_recorded_resume(case: Case, backend: str, recorded: str, references: Path) -> None:
    """A live train state restored from the recorded one-step state continues as recorded.

    The recorded state after step 1 is placed into a fresh live state (every leaf,
    nothing left at its initialiser); steps 2 onward equal the recorded ones. In float32
    and in bfloat16 compute, each from the state recorded in that dtype.
    """
    live, reference = recorded_pair(case, backend, recorded, references)
    resumed = "resumed from the recorded step 1"
    recorded_step_parity(case, live, reference, resumed, lambda side: _resumed(side, reference), 2)


@_against_recorded(capability="decode")
def check_recorded_decode(case: Case, backend: str, recorded: str, references: Path) -> None:
    """Prefill and greedy decode from the recorded parameters equal the recorded ones.

    Prefill logits on real prompt tokens, every decode step's logits, and the greedy
    tokens, for the same prompts (the family's batch must not have changed).
    """
    live, reference = recorded_pair(case, backend, recorded, references)
    decoded = reference.decoded()
    if decoded is None:
        fail(f"{reference.label} holds no decode: record it again")
    family, config = live.case.family, live.case.bound
    if not np.array_equal(
        host_array(family.batch(config, BATCH_SIZE).tokens), reference.batch().tokens
    ):
        fail(f"{family.name}'s batch changed since {reference.label}: record it again")
    generation = live.generate(recorded_params(live, reference), decoded["steps"].shape[0])
    expected = {
        "prefill": prompt_only(decoded["prefill"], decoded["lengths"]),
        "steps": decoded["steps"],
        "tokens": decoded["tokens"],
    }
    got = {
        "prefill": prompt_only(generation.prefill_logits, generation.lengths),
        "steps": generation.step_logits,
        "tokens": generation.tokens,
    }
    names = (reference.name, live.name)
    mismatches = compare_trees(expected, got)
    if mismatches:
        title = against_title(live, reference, "prefill and decode")
        fail_against(live, reference, report(title, mismatches, names))


@_against_recorded((Axis.FAMILY, Axis.QUANT, Axis.RECORDED), known_failure=_known_qwix_failure)
def check_recorded_quant_forward(case: Case, backend: str, recorded: str, references: Path) -> None:
    """The live quantized forward of the recorded float parameters equals the recorded one.

    Quantization-aware (:func:`~conformance.checks.kernel.quantized_forwards`): the
    recorded float32 logits are the recording's float twin, so quantized logits that
    differ by float rounding carried across quantization steps (a recording made on
    another machine) pass, judged by how far a one-ulp nudge of the recorded parameters
    moves the live side.
    """
    live, reference = recorded_pair(case, backend, recorded, references)
    quant = live.case.quant
    expected = reference.logits(f"quant/{quant}")
    if expected is None:
        left_out = "; ".join(reference.reference.manifest.get("not_recorded", ()))
        fail(f"{reference.label} holds no {quant} logits ({left_out or 'not recorded'})")
    float_side = live.unquantized()
    params = recorded_params(float_side, reference)
    batch = live.case.place(reference.batch())
    logits = host_array(live.forward(live.runner.quantize(params), batch)[0])
    float_logits = (
        reference.logits("forward/float32"),
        host_array(float_side.forward(params, batch)[0]),
    )

    def rerun(nudged: Flat) -> jax.Array:
        return live.forward(live.runner.quantize(float_side.place(nudged)), batch)[0]

    title = against_title(live, reference, f"{quant} forward")
    title += " (index: batch, position, vocab)"
    message = quantized_forwards(
        title,
        (reference.name, live.name),
        (expected, logits),
        float_logits,
        (None, rerun),
        (None, params),
        error_spread=RECORDED_ERROR_SPREAD,
    )
    if message is not None:
        fail_against(live, reference, message)
