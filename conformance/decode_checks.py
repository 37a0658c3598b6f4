"""Prefill and decode checks: the KV cache's layout, self-consistency and Linen/NNX parity.

Both backends serve the same parameters (Linen's, transplanted to NNX) through the same
loop (:func:`conformance.runtime.decoding.generate`): right-padded prompts of different lengths,
then :data:`DECODE_STEPS` greedy tokens. A backend is self-consistent when its prefill
logits and every decode step's logits equal its own full-sequence forward on the prompt
plus the tokens it generated; the backends agree when their logits agree at prefill and
at every step and their greedy tokens are identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding

from conformance.checks import (
    BATCH_SIZE,
    agreed_specs,
    fail,
    fail_if_any,
    misplaced,
    param_map,
    place_batch,
    shardings_for,
)
from conformance.contract import Family
from conformance.core.distributed import host_array
from conformance.core.numerics import (
    Mismatch,
    compare_arrays,
    compare_trees,
    report,
    tolerance_for,
)
from conformance.core.records import emit_verdict
from conformance.core.scope import scoped
from conformance.core.sharding import MeshSpec, spec_to_json
from conformance.core.trees import Flat, PathMapError, map_paths, structure_diff
from conformance.runtime.backends import linen_runner, nnx_runner, transplant
from conformance.runtime.decoding import (
    DecodeError,
    Generation,
    LinenDecoder,
    NnxDecoder,
    generate,
    linen_decoder,
    nnx_decoder,
    prompt_batch,
)
from conformance.runtime.diagnose.attribution import attribution_text, one_device

DECODE_STEPS = 8
"""Greedy decode steps after prefill; with the prefill's token, 9 generated tokens."""


def decoders(family: Family, check: str, config: Any) -> tuple[LinenDecoder, NnxDecoder]:
    """Both sides' decoders for :data:`BATCH_SIZE` prompts; a family that cannot serve fails."""
    try:
        return linen_decoder(family, config, BATCH_SIZE), nnx_decoder(family, config, BATCH_SIZE)
    except DecodeError as err:
        fail(family, check, str(err))


def check_decode_cache(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh | None = None
) -> dict[str, Any]:
    """Both sides' caches have the same leaves, shapes, dtypes and PartitionSpecs.

    The cache's paths map like parameter paths (the family's ``path_rules``). With
    ``devices``, both empty caches are created on the mesh and checked to be placed
    with their specs. Returns the golden payload.
    """
    if devices is not None:
        config = family.with_mesh(config, devices)
    check = "decode_cache"
    linen, nnx_ = decoders(family, check, config)
    try:
        mapping = map_paths(family.path_rules(config), linen.specs)
    except PathMapError as err:
        fail(family, check, str(err))
    problems = structure_diff(linen.specs, nnx_.specs, mapping)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(family, check, f"{len(problems)} cache difference(s) ({counts})", problems)
    linen_specs, nnx_specs = agreed_specs(
        family, check, linen, nnx_, mapping, mesh, family.axis_rules(config)
    )
    if devices is not None:
        for side, decoder, resolved in (("Linen", linen, linen_specs), ("NNX", nnx_, nnx_specs)):
            shardings = {p: NamedSharding(devices, s) for p, s in resolved.items()}
            placed = misplaced(decoder.init_cache(shardings), shardings)
            fail_if_any(family, check, f"{side} cache arrays placed off their specs", placed)
    return {
        "mesh": dict(mesh.axes),
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
    """The parameters it served (Linen's init; on NNX, transplanted), on the mesh."""
    generation: Generation
    forward_logits: np.ndarray
    """``[rows, sequence length, vocab]``: the plain forward on ``generation.sequence``."""


@scoped
def serve_both(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> tuple[Served, ...]:
    """Serve Linen's parameters on both backends; computed once per family, config and mesh."""
    return _serve(family, config, mesh, devices, None)


def _serve(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh, start: Flat | None
) -> tuple[Served, ...]:
    """Both sides served from Linen's init, or from Linen parameters ``start`` when given."""
    config = family.with_mesh(config, devices)
    check = "decode"
    linen_dec, nnx_dec = decoders(family, check, config)
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    mapping = param_map(family, check, config)
    linen_shardings = shardings_for(family, check, linen.logical, mesh, devices)
    linen_params = (
        linen.init(0, linen_shardings)
        if start is None
        else transplant(start, {}, linen.specs, linen_shardings)
    )
    nnx_shardings = shardings_for(family, check, nnx_.logical, mesh, devices)
    nnx_params = transplant(linen_params, mapping, nnx_.specs, nnx_shardings)
    prompt, lengths = prompt_batch(family, config, BATCH_SIZE, DECODE_STEPS)

    def place(batch: Any) -> Any:
        return place_batch(family, batch, mesh, devices)

    served = []
    for side, decoder, runner, params in (
        ("Linen", linen_dec, linen, linen_params),
        ("NNX", nnx_dec, nnx_, nnx_params),
    ):
        cache_shardings = shardings_for(family, check, decoder.logical, mesh, devices)
        generation = generate(
            decoder, params, prompt, lengths, DECODE_STEPS, place, cache_shardings
        )
        sequence = place(generation.sequence(family.sequence_length(config)))
        forward_logits = host_array(runner.forward(params, sequence)[0])
        served.append(Served(side, params, generation, forward_logits))
    return tuple(served)


def _stages(generation: Generation, upto: int) -> Flat:
    """The logits of prefill (real prompt positions only) and of decode steps before ``upto``."""
    stages = {"prefill/logits": _prompt_only(generation.prefill_logits, generation.lengths)}
    stages |= {f"decode step {step}/logits": generation.step_logits[step] for step in range(upto)}
    return stages


def _decode_attribution(
    family: Family, config: Any, mesh: MeshSpec, served: tuple[Served, ...], upto: int
) -> str:
    """Which side's prefill and first ``upto`` decode steps move when served on one device."""

    def on_one_device() -> tuple[Flat, Flat]:
        one = one_device(mesh)
        again = _serve(family, config, one, one.devices(), served[0].params)
        return _stages(again[0].generation, upto), _stages(again[1].generation, upto)

    on_mesh = (_stages(served[0].generation, upto), _stages(served[1].generation, upto))
    return attribution_text(mesh, ("Linen", "NNX"), on_mesh, on_one_device)


def _prompt_only(logits: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Prefill-shaped logits with every padding position zeroed: padding is not compared."""
    width = logits.shape[1]
    real = np.arange(width)[None, :] < lengths[:, None]
    return np.where(real[:, :, None], logits, 0)


def _at_step(logits: np.ndarray, lengths: np.ndarray, step: int) -> np.ndarray:
    """``[rows, vocab]``: each row's full-forward logits at its decode-step position."""
    return logits[np.arange(len(lengths)), lengths + step]


def _step_title(mismatch: Mismatch, lengths: np.ndarray, step: int) -> str:
    """``decode step t of N (row r at position p)`` for the worst row of ``mismatch``."""
    row = mismatch.index[0] if mismatch.index else 0
    return f"decode step {step} of {DECODE_STEPS} (row {row} at position {lengths[row] + step})"


def _chosen_from(generation: Generation, index: int, row: int) -> np.ndarray:
    """The logits greedy token ``index`` of ``row`` was chosen from."""
    if index == 0:
        return generation.prefill_logits[row, generation.lengths[row] - 1]
    return generation.step_logits[index - 1, row]


def check_decode_consistency(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """On each backend, prefill and every decode step reproduce the full forward's logits.

    Prefill is compared on real prompt tokens; decode step ``t`` of row ``r`` against
    the forward at position ``lengths[r] + t`` of the prompt followed by the fed tokens.
    """
    check = "decode_consistency"
    for served in serve_both(family, config, mesh, devices):
        gen, side = served.generation, served.side
        tol = tolerance_for(gen.prefill_logits.dtype)
        names = ("forward", side)
        width = gen.prefill_logits.shape[1]
        expected = _prompt_only(served.forward_logits[:, :width], gen.lengths)
        prefill = _prompt_only(gen.prefill_logits, gen.lengths)
        found = compare_arrays("logits", expected, prefill, tol)
        plot = {"names": names, "tolerance": tol, "series": side}
        plot["figure"] = f"{check}: error per stage against the forward, mesh {mesh.id}"
        emit_verdict(f"{side} prefill", "logits", expected, prefill, found, x="prefill", **plot)
        if found is not None:
            title = (
                f"{side} prefill vs the full-sequence forward on mesh {mesh.id} "
                "(index: row, position, vocab)"
            )
            fail(family, check, report(title, [found], names))
        for step in range(DECODE_STEPS):
            expected = _at_step(served.forward_logits, gen.lengths, step)
            found = compare_arrays("logits", expected, gen.step_logits[step], tol)
            x = f"step {step}"
            emit_verdict(
                f"{side} {x}", "logits", expected, gen.step_logits[step], found, x=x, **plot
            )
            if found is not None:
                title = f"{side} {_step_title(found, gen.lengths, step)}"
                fail(family, check, report(f"{title} vs the full forward", [found], names))


def check_decode(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """Linen and NNX agree at prefill and at every decode step, and generate the same tokens.

    Stops at the first stage that differs: after a different token the two sides decode
    different sequences, so later stages are not comparable.
    """
    check = "decode"
    served = serve_both(family, config, mesh, devices)
    linen, nnx_ = (s.generation for s in served)
    cache_map = map_paths(family.path_rules(config), linen.caches[0])
    tol = tolerance_for(linen.prefill_logits.dtype)
    names = ("Linen", "NNX")
    prefills = (
        _prompt_only(linen.prefill_logits, linen.lengths),
        _prompt_only(nnx_.prefill_logits, nnx_.lengths),
    )
    found = compare_arrays("logits", *prefills, tol)
    plot = {"names": names, "tolerance": tol, "series": "Linen vs NNX"}
    plot["figure"] = f"{check}: error per stage, mesh {mesh.id}"
    emit_verdict("prefill", "logits", *prefills, found, x="prefill", **plot)
    if found is not None:
        title = f"prefill on mesh {mesh.id} (index: row, position, vocab)"
        where = _first_cache_divergence(linen, nnx_, cache_map, 0, tol)
        moved = _decode_attribution(family, config, mesh, served, 0)
        fail(family, check, report(title, [found], names) + where + f"\n  {moved}")
    _check_tokens(family, linen, nnx_, 0, "prefill")
    for step in range(DECODE_STEPS):
        logits = linen.step_logits[step], nnx_.step_logits[step]
        found = compare_arrays("logits", *logits, tol)
        x = f"step {step}"
        emit_verdict(x, "logits", *logits, found, x=x, **plot)
        if found is not None:
            title = f"{_step_title(found, linen.lengths, step)} on mesh {mesh.id}"
            where = _first_cache_divergence(linen, nnx_, cache_map, step + 1, tol)
            moved = _decode_attribution(family, config, mesh, served, step + 1)
            fail(family, check, report(title, [found], names) + where + f"\n  {moved}")
        _check_tokens(family, linen, nnx_, step + 1, f"decode step {step}")


def _first_cache_divergence(
    linen: Generation, nnx_: Generation, mapping: dict[str, str], upto: int, tol: Any
) -> str:
    """Where the two caches first differ, up to stage ``upto`` (0 is after prefill)."""
    for stage in range(upto + 1):
        moved = {mapping[p]: v for p, v in linen.caches[stage].items()}
        mismatches = compare_trees(moved, nnx_.caches[stage], tol)
        if mismatches:
            when = "prefill" if stage == 0 else f"decode step {stage - 1}"
            return "\n  the caches first differ after " + report(when, mismatches, ("Linen", "NNX"))
    return "\n  the caches agree up to here: the divergence is outside the cache"


def _check_tokens(
    family: Family, linen: Generation, nnx_: Generation, index: int, stage: str
) -> None:
    """Fail if the greedy tokens chosen after ``stage`` differ in any row."""
    rows = np.flatnonzero(linen.tokens[:, index] != nnx_.tokens[:, index])
    if rows.size == 0:
        return
    lines = []
    for row in rows:
        a, b = linen.tokens[row, index], nnx_.tokens[row, index]
        la, lb = _chosen_from(linen, index, row), _chosen_from(nnx_, index, row)
        lines.append(
            f"row {row}: Linen token {a} (logit {la[a]!r}, NNX gives it {lb[a]!r}); "
            f"NNX token {b} (logit {lb[b]!r}, Linen gives it {la[b]!r})"
        )
    fail_if_any(
        family,
        "decode",
        f"greedy token {index} (chosen after {stage}) differs in {rows.size} row(s); "
        "the logits agreed within tolerance, so this is a near tie",
        lines,
    )
