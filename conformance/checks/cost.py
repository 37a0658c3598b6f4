"""Compiled-cost parity: NNX's programs cost no more than Linen's, and run the same collectives.

The same holds between two modes of NNX (the ``pair`` axis): tree mode costs no more
than graph mode, explicit axes no more than auto ones.

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

from conformance.checks.declare import Axis, declare
from conformance.checks.kernel import train_pair
from conformance.contract import Remat, declared, supports
from conformance.core.cost import Cost, cost_of, over_budget
from conformance.core.failure import fail_if_any
from conformance.core.records import Costs, emit
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.generation import step_batch
from conformance.runtime.sides import live_pair
from conformance.runtime.stepping import Training


def _decode_step(training: Training) -> Cost:
    """The cost of one decode call of ``training``'s side: a token per row against a cache."""
    side = training.side
    case = side.case
    decoder = side.decoder(BATCH_SIZE)
    shardings = case.shardings(decoder.logical)
    at = np.zeros((BATCH_SIZE, 1), np.int32)
    batch = case.place(step_batch(at, at))
    cache = decoder.init_cache(shardings)
    return cost_of(decoder.lowered("decode", training.initial, cache, batch, shardings).compile())


def _programs(case: Case) -> dict[str, tuple[Cost, Cost]]:
    """``{program: (the first side's cost, the second's)}`` on ``case``'s mesh."""
    found = {}
    variants = {"": case}
    if (remat := declared(case.family, Remat)) is not None:
        variants[" (remat)"] = case.with_config(remat.config(case.config))
    for suffix, variant in variants.items():
        pair = train_pair(variant)
        batch = variant.batch()
        if not suffix:
            found["forward"] = tuple(
                cost_of(t.side.runner.lowered_forward(t.initial, batch).compile()) for t in pair
            )
            if supports(case.family, "decode"):
                found["decode_step"] = tuple(_decode_step(t) for t in pair)
        found[f"train_step{suffix}"] = tuple(
            cost_of(t.step.lower(t.state, batch).compile()) for t in pair
        )
    return found


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS, Axis.PAIR),
    where="primary",
    golden=True,
    golden_by_platform=True,
    costly_pairs=True,
)
def check_cost(case: Case) -> dict[str, Any]:
    """NNX's forward, train and decode steps cost at most ``BUDGET`` of Linen's, alike.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis),
    which have no golden of their own: the second costs at most ``BUDGET`` of the first.
    Compared per program: flops, bytes accessed, argument, output and temporary memory
    (the second side may cost less; the scanned rematerialised step's memory within
    ``SCANNED_REMAT_TEMP``), and every collective kind's count (equal) and bytes
    (:func:`~conformance.core.cost.over_budget`).
    Aliased bytes are kept in the golden, not compared: the harness donates no input.
    Each program's costs go to the report's cost table, keyed by side; returned as the
    golden (kept per platform, XLA level and mesh), so a change of cost between runs or
    releases shows as a golden diff.
    """
    first, second = live_pair(case)
    names = (first.name, second.name)
    programs = _programs(case)
    tables = {
        name: {first.key: a.table(), second.key: b.table()} for name, (a, b) in programs.items()
    }
    for name, sides in tables.items():
        emit(Costs(name, sides))
    problems = [
        line
        for name, pair in programs.items()
        for line in over_budget(name, *pair, scanned=case.scan_layers, names=names)
    ]
    fail_if_any(f"{second.name} costs more than {first.name} on mesh {case.mesh.id}", problems)
    return {"mesh": case.mesh.id, "programs": tables}
