"""Prefill and decode checks: the KV cache's layout, self-consistency and the sides' parity.

Both sides of a case (Linen and NNX, or the NNX model in two modes) serve the same
parameters (the first side's, transplanted to the second) through the same loop
(:func:`conformance.runtime.generation.generate`): right-padded prompts of different
lengths, then :data:`DECODE_STEPS` greedy tokens. A side is self-consistent when its
prefill logits and every decode step's logits equal its own full-sequence forward on the
prompt plus the tokens it generated; the sides agree when their logits agree at prefill
and at every step and their greedy tokens are identical.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import (
    agreed_specs,
    attributed,
    compared,
    misplaced,
    shared_params,
)
from conformance.core.distributed import host_array
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import Mismatch, compare_trees, report, tolerance_for
from conformance.core.rounding import RoundingVerdict, pair_within_rounding, within_rounding
from conformance.core.scope import scoped
from conformance.core.sharding import spec_to_json
from conformance.core.trees import Flat, PathMapError, map_paths, structure_diff
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.decoding import DecodeError
from conformance.runtime.generation import Generation, prompt_only
from conformance.runtime.sides import Decoder, Side, live_pair

DECODE_STEPS = 8
"""Greedy decode steps after prefill; with the prefill's token, 9 generated tokens."""


def decoders(case: Case) -> tuple[Decoder, Decoder]:
    """Both sides' decoders for :data:`BATCH_SIZE` prompts; a family that cannot serve fails."""
    try:
        return tuple(side.decoder(BATCH_SIZE) for side in live_pair(case))
    except DecodeError as err:
        fail(str(err))


@declare(ON_MESH, capability="decode", golden=True)
def check_decode_cache(case: Case) -> dict[str, Any]:
    """Both sides' caches have the same leaves, shapes, dtypes and PartitionSpecs.

    The cache's paths map like parameter paths (the family's ``path_rules``). On a
    device mesh, both empty caches are created there and checked to be placed with
    their specs. Returns the golden payload.
    """
    linen, nnx_ = decoders(case)
    try:
        mapping = map_paths(case.family.path_rules(case.bound), linen.specs)
    except PathMapError as err:
        fail(str(err))
    problems = structure_diff(linen.specs, nnx_.specs, mapping)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(f"{len(problems)} cache difference(s) ({counts})", problems)
    sides = live_pair(case)
    linen_specs, nnx_specs = agreed_specs(
        (sides[0], linen.logical, linen.specs), (sides[1], nnx_.logical, nnx_.specs), mapping
    )
    if case.devices is not None:
        for side, decoder, resolved in zip(
            sides, (linen, nnx_), (linen_specs, nnx_specs), strict=True
        ):
            shardings = {p: NamedSharding(case.devices, s) for p, s in resolved.items()}
            placed = misplaced(decoder.init_cache(shardings), shardings)
            fail_if_any(f"{side.name} cache arrays placed off their specs", placed)
    return {
        "mesh": dict(case.mesh.axes),
        "rows": BATCH_SIZE,
        "leaf_count": len(nnx_.specs),
        "leaves": {
            path: {
                "shape": list(spec.shape),
                "dtype": spec.dtype,
                "logical": list(nnx_.logical[path] or ()),
                "spec": spec_to_json(nnx_specs[path], len(spec.shape)),
            }
            for path, spec in sorted(nnx_.specs.items())
        },
    }


@dataclasses.dataclass(frozen=True)
class Served:
    """One side's generation and its own full forward over what it generated."""

    side: str
    params: Flat
    """The parameters it served (the first side's init; on the second, transplanted)."""
    generation: Generation
    forward_logits: np.ndarray
    """``[rows, sequence length, vocab]``: the plain forward on ``generation.sequence``."""


@scoped
def serve_both(case: Case) -> tuple[Served, ...]:
    """Serve the first side's parameters on both sides of ``case``; computed once per case."""
    return _serve(live_pair(case), None)


def _serve(
    sides: tuple[Side, Side], start: Flat | None, forced: bool = False
) -> tuple[Served, ...]:
    """Both sides served from the first's init, or from its parameters ``start`` when given.

    ``forced``: the second side is fed the first side's greedy tokens (teacher forcing).
    """
    case = sides[0].case
    decoders(case)
    params = shared_params(*sides, start)
    served: list[Served] = []
    for side, side_params in zip(sides, params, strict=True):
        fed = served[0].generation.tokens if forced and served else None
        generation = side.generate(side_params, DECODE_STEPS, forced=fed)
        sequence = case.place(generation.sequence(case.family.sequence_length(case.bound)))
        forward_logits = host_array(side.forward(side_params, sequence)[0])
        served.append(Served(side.name, side_params, generation, forward_logits))
    return tuple(served)


def _stages(generation: Generation, upto: int) -> Flat:
    """The logits of prefill (real prompt positions only) and of decode steps before ``upto``."""
    stages = {"prefill/logits": prompt_only(generation.prefill_logits, generation.lengths)}
    stages |= {f"decode step {step}/logits": generation.step_logits[step] for step in range(upto)}
    return stages


def _decode_attribution(
    case: Case, start: Flat, generations: tuple[Generation, Generation], upto: int, forced: bool
) -> str:
    """Which side's prefill and first ``upto`` decode steps move when served on one device.

    ``generations`` were served on the mesh from the first side's ``start``; ``forced``:
    the second was fed the first's tokens, and is so again on one device.
    """
    sides = live_pair(case)

    def on_one_device() -> tuple[Flat, Flat]:
        again = _serve(tuple(side.reference() for side in sides), start, forced)
        return _stages(again[0].generation, upto), _stages(again[1].generation, upto)

    on_mesh = (_stages(generations[0], upto), _stages(generations[1], upto))
    return attributed(case, (sides[0].name, sides[1].name), on_mesh, on_one_device)


def _at_step(logits: np.ndarray, lengths: np.ndarray, step: int) -> np.ndarray:
    """``[rows, vocab]``: each row's full-forward logits at its decode-step position."""
    return logits[np.arange(len(lengths)), lengths + step]


def _step_title(mismatch: Mismatch, lengths: np.ndarray, step: int) -> str:
    """``decode step t of N (row r at position p)`` for the worst row of ``mismatch``."""
    row = mismatch.index[0] if mismatch.index else 0
    return f"decode step {step} of {DECODE_STEPS} (row {row} at position {lengths[row] + step})"


def _forward_stages(forward_logits: np.ndarray, gen: Generation) -> list[np.ndarray]:
    """A forward's logits where each stage of ``gen`` ran.

    Prefill's at the real prompt positions, then decode step ``t``'s of row ``r`` at
    position ``lengths[r] + t``.
    """
    width = gen.prefill_logits.shape[1]
    prefill = prompt_only(forward_logits[:, :width], gen.lengths)
    return [prefill, *(_at_step(forward_logits, gen.lengths, t) for t in range(DECODE_STEPS))]


def _float32_forward(case: Case, index: int, served: Served) -> list[np.ndarray]:
    """:func:`_forward_stages` of side ``index``'s float32 forward over what it generated."""
    side = live_pair(case.in_dtype(jnp.float32))[index]
    sequence = case.place(served.generation.sequence(case.family.sequence_length(case.bound)))
    return _forward_stages(host_array(side.forward(served.params, sequence)[0]), served.generation)


@declare((*ON_MESH, Axis.DTYPE), capability="decode")
def check_decode_consistency(case: Case) -> None:
    """On each backend, prefill and every decode step reproduce the full forward's logits.

    Prefill is compared on real prompt tokens; decode step ``t`` of row ``r`` against
    the forward at position ``lengths[r] + t`` of the prompt followed by the fed tokens.
    In bfloat16 compute a stage beyond the policy passes when it is within rounding of
    the forward (:func:`~conformance.core.rounding.within_rounding`, against the same
    side's float32 forward over the same tokens).
    """
    mesh = case.mesh
    for index, served in enumerate(serve_both(case)):
        gen, side = served.generation, served.side
        tol = tolerance_for(gen.prefill_logits.dtype)
        names = ("forward", side)
        plot = {"names": names, "tolerance": tol, "series": side}
        plot["figure"] = f"decode_consistency: error per stage against the forward, mesh {mesh.id}"
        stages = _forward_stages(served.forward_logits, gen)
        twins = functools.cache(functools.partial(_float32_forward, case, index, served))
        actual = _stages(gen, DECODE_STEPS).values()
        for stage, (expected, got) in enumerate(zip(stages, actual, strict=True)):
            verdicts: list[RoundingVerdict] = []
            judge = None
            if case.dtype != jnp.float32:
                judge = functools.partial(_rounding, verdicts, expected, got, twins, stage)
            x = "prefill" if stage == 0 else f"step {stage - 1}"
            found = compared(f"{side} {x}", expected, got, x=x, judge=judge, **plot)
            if found is None:
                continue
            if stage == 0:
                title = f"{side} prefill vs the full-sequence forward on mesh {mesh.id}"
                title += " (index: row, position, vocab)"
            else:
                title = f"{side} {_step_title(found, gen.lengths, stage - 1)} vs the full forward"
            rounding = f"\n  bfloat16 rounding: {verdicts[0].text}" if verdicts else ""
            fail(report(title, [found], names) + rounding)


def _rounding(
    verdicts: list[RoundingVerdict],
    expected: np.ndarray,
    got: np.ndarray,
    twins: Callable[[], list[np.ndarray]],
    stage: int,
    found: Mismatch,
) -> bool:
    """Judge a stage beyond the policy by rounding; keeps the verdict for the report."""
    del found
    verdicts.append(within_rounding(expected, got, twins()[stage]))
    return verdicts[-1].accepted


@declare((*ON_MESH, Axis.DTYPE, Axis.PAIR), capability="decode")
def check_decode(case: Case) -> None:
    """The case's two sides agree at prefill and at every decode step, and generate the same tokens.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis).
    Stops at the first stage that differs: after a different token the two sides decode
    different sequences, so later stages are not comparable. In bfloat16 compute the
    second side is fed the first's greedy tokens (teacher forcing), since rounding may
    break a near tie either way: the tokens are not compared, every stage's logits are,
    and a stage beyond the policy passes when both sides' float32 decodes of the same
    tokens agree and the second is within rounding of the first
    (:func:`~conformance.core.rounding.within_rounding`, against the first's float32
    decode).
    """
    mesh = case.mesh
    served = serve_both(case)
    lowered = case.dtype != jnp.float32
    params = served[0].params, served[1].params
    first_side, second_side = live_pair(case)
    first = served[0].generation
    second = served[1].generation
    if lowered:
        second = second_side.generate(params[1], DECODE_STEPS, forced=first.tokens)
    try:
        cache_map = map_paths(first_side.path_rules(), first.caches[0])
    except PathMapError as err:
        fail(str(err))
    tol = tolerance_for(first.prefill_logits.dtype)
    names = (served[0].side, served[1].side)
    plot = {"names": names, "tolerance": tol, "series": " vs ".join(names)}
    plot["figure"] = f"decode: error per stage, mesh {mesh.id}"
    twins = functools.cache(functools.partial(_float32_stages, case, params, first.tokens))
    stages = (_stages(gen, DECODE_STEPS).values() for gen in (first, second))
    for stage, logits in enumerate(zip(*stages, strict=True)):
        x = "prefill" if stage == 0 else f"step {stage - 1}"
        verdicts: list[RoundingVerdict] = []
        judge = None
        if lowered:
            judge = functools.partial(_judged, verdicts, logits, twins, stage)
        found = compared(x, *logits, x=x, judge=judge, **plot)
        if found is not None:
            title = f"prefill on mesh {mesh.id} (index: row, position, vocab)"
            if stage:
                title = f"{_step_title(found, first.lengths, stage - 1)} on mesh {mesh.id}"
            where = _first_cache_divergence(first, second, cache_map, stage, tol, names)
            moved = _decode_attribution(case, params[0], (first, second), stage, lowered)
            rounding = f"\n  bfloat16 rounding: {verdicts[0].text}" if verdicts else ""
            fail(report(title, [found], names) + where + f"\n  {moved}" + rounding)
        if not lowered:
            stage_name = "prefill" if stage == 0 else f"decode {x}"
            _check_tokens((first, second), names, stage, stage_name)


def _float32_stages(
    case: Case, params: tuple[Flat, Flat], tokens: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Both sides' stages in float32 compute from ``params``, each fed ``tokens``."""
    sides = live_pair(case.in_dtype(jnp.float32))
    first, second = (
        list(_stages(side.generate(p, DECODE_STEPS, forced=tokens), DECODE_STEPS).values())
        for side, p in zip(sides, params, strict=True)
    )
    return first, second


def _judged(
    verdicts: list[RoundingVerdict],
    logits: tuple[np.ndarray, np.ndarray],
    twins: Callable[[], tuple[list[np.ndarray], list[np.ndarray]]],
    stage: int,
    found: Mismatch,
) -> bool:
    """Judge a stage of the two sides beyond the policy by rounding; keeps the verdict."""
    del found
    first, second = (twin[stage] for twin in twins())
    verdicts.append(pair_within_rounding("decodes", logits, (first, second)))
    return verdicts[-1].accepted


def _first_cache_divergence(
    first: Generation,
    second: Generation,
    mapping: dict[str, str],
    upto: int,
    tol: Any,
    names: tuple[str, str],
) -> str:
    """Where the two caches first differ, up to stage ``upto`` (0 is after prefill)."""
    for stage in range(upto + 1):
        moved = {mapping[p]: v for p, v in first.caches[stage].items()}
        mismatches = compare_trees(moved, second.caches[stage], tol)
        if mismatches:
            when = "prefill" if stage == 0 else f"decode step {stage - 1}"
            return "\n  the caches first differ after " + report(when, mismatches, names)
    return "\n  the caches agree up to here: the divergence is outside the cache"


def _check_tokens(
    generations: tuple[Generation, Generation], names: tuple[str, str], index: int, stage: str
) -> None:
    """Fail if the greedy tokens the two sides (``names``) chose after ``stage`` differ."""
    (first, second), (one, other) = generations, names
    rows = np.flatnonzero(first.tokens[:, index] != second.tokens[:, index])
    if rows.size == 0:
        return
    lines = []
    for row in rows:
        a, b = first.tokens[row, index], second.tokens[row, index]
        la, lb = first.chosen_from(index, row), second.chosen_from(index, row)
        lines.append(
            f"row {row}: {one} token {a} (logit {la[a]!r}, {other} gives it {lb[a]!r}); "
            f"{other} token {b} (logit {lb[b]!r}, {one} gives it {la[b]!r})"
        )
    fail_if_any(
        f"greedy token {index} (chosen after {stage}) differs in {rows.size} row(s); "
        "the logits agreed within tolerance, so this is a near tie",
        lines,
    )
