"""Compiled-cost parity: NNX's programs cost no more than Linen's, and run the same collectives.

For the forward, the train step and (for a family that decodes) one decode call on the
case's mesh, and, for a family with remat, the rematerialised train step, as production
trains, each side's compiled program is read back: the harness hands the live
executable to every compile of a program it already compiled
(:mod:`conformance.core.programs`), so reading costs no compile when the forward,
train-step and decode checks of the case ran first. Equal numbers do not make equal
programs: a backend that drops remat, replicates a kernel the other shards, or stacks
a read-only parameter per layer computes the same values at another cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.checks.kernel import train_pair
from conformance.core.cost import Cost, cost_of
from conformance.core.failure import fail_if_any
from conformance.core.records import Costs, emit
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.decoding import step_batch
from conformance.runtime.stepping import Training

BUDGET = {
    "flops": 1.05,
    "bytes_accessed": 1.10,
    "argument_bytes": 1.10,
    "output_bytes": 1.10,
    "temp_bytes": 1.10,
}
"""How much more than Linen NNX may cost, per measure (NNX costing less always passes)."""

SCANNED_REMAT_TEMP = 1.30
"""The temporary-memory budget of the rematerialised train step in the scanned layout.

With flax 0.12.12, ``nnx.remat`` inside ``nnx.scan`` keeps more temporary memory than
``nn.remat`` inside ``nn.scan`` for the same blocks, whoever writes them: 1.237x (gpt3),
1.160x (llama) and 1.135x (the contract example's toy-full, written independently) on
``data=2,fsdp=2,tensor=2``; 1.039x and 1.015x on ``fsdp=8``. Dropping remat costs 2.6x."""


def _decode_step(training: Training) -> Cost:
    """The cost of one decode call of ``training``'s side: a token per row against a cache."""
    side = training.side
    case = side.case
    decoder = side.decoder(BATCH_SIZE)
    shardings = case.shardings(decoder.logical)
    at = np.zeros((BATCH_SIZE, 1), np.int32)
    batch = case.place(step_batch(at, at))
    cache = decoder.init_cache(shardings)
    return cost_of(decoder.compiled("decode", training.initial, cache, batch, shardings))


def _programs(case: Case) -> dict[str, tuple[Cost, Cost]]:
    """``{program: (Linen's cost, NNX's cost)}`` on ``case``'s mesh."""
    found = {}
    variants = {"": case}
    if case.family.capabilities.remat:
        variants[" (remat)"] = case.with_config(case.family.variant(case.config, remat=True))
    for suffix, variant in variants.items():
        pair = train_pair(variant)
        batch = variant.batch()
        if not suffix:
            found["forward"] = tuple(
                cost_of(t.side.runner.compiled_forward(t.initial, batch)) for t in pair
            )
            if case.family.capabilities.decode:
                found["decode_step"] = tuple(_decode_step(t) for t in pair)
        found[f"train_step{suffix}"] = tuple(
            cost_of(t.step.lower(t.state, batch).compile()) for t in pair
        )
    return found


def _over_budget(program: str, linen: Cost, nnx_: Cost, scanned: bool) -> list[str]:
    problems = []
    budgets = dict(BUDGET)
    if scanned and program.endswith("(remat)"):
        budgets["temp_bytes"] = SCANNED_REMAT_TEMP
    for measure, budget in budgets.items():
        a, b = getattr(linen, measure), getattr(nnx_, measure)
        if b > a * budget:
            ratio = f" ({b / a:.3f} x)" if a else ""
            problems.append(
                f"{program}: {measure} NNX {b:,.0f} > {budget:g} x Linen {a:,.0f}{ratio}"
            )
    for kind in sorted(linen.collectives.keys() | nnx_.collectives.keys()):
        (count_a, bytes_a), (count_b, bytes_b) = (
            side.collectives.get(kind, (0, 0)) for side in (linen, nnx_)
        )
        if count_a != count_b or bytes_b > bytes_a * BUDGET["bytes_accessed"]:
            problems.append(
                f"{program}: {kind} Linen {count_a} op(s) of {bytes_a:,} bytes, "
                f"NNX {count_b} op(s) of {bytes_b:,} bytes"
            )
    return problems


def check_cost(case: Case) -> dict[str, Any]:
    """NNX's forward, train and decode steps cost at most :data:`BUDGET` of Linen's, alike.

    Compared per program: flops, bytes accessed, argument, output and temporary memory
    (NNX may cost less; the scanned rematerialised step's memory within
    :data:`SCANNED_REMAT_TEMP`), and every collective kind's count (equal) and bytes.
    Aliased bytes are kept in the golden, not compared: the harness donates no input.
    Each program's costs go to the report's cost table; returned as the golden (kept
    per platform, XLA level and mesh), so a change of cost between runs or releases
    shows as a golden diff.
    """
    programs = _programs(case)
    tables = {
        name: {"linen": linen.table(), "nnx": nnx_.table()}
        for name, (linen, nnx_) in programs.items()
    }
    for name, sides in tables.items():
        emit(Costs(name, sides))
    problems = [
        line
        for name, pair in programs.items()
        for line in _over_budget(name, *pair, case.scan_layers)
    ]
    fail_if_any(f"NNX costs more than Linen on mesh {case.mesh.id}", problems)
    return {"mesh": case.mesh.id, "programs": tables}
