"""Activation shardings: how the compiled forward lays out every module call's values.

Parameters, optimizer state and caches are placed by the specs each side asks for; the
activations are laid out by the compiler, from those specs and from each model's
activation constraints. A migration that forgets a constraint, writes it under another
logical name or axis order, or constrains another tensor computes the same numbers and
pays for it in collectives and memory. ``activation_sharding`` compiles each side's
forward and train step once each with probes on every module call
(:mod:`conformance.runtime.activations`) and compares the two, call by call, on each
device mesh; ``activation_sharding_tpu`` does the same for a TPU slice, compiled by
libtpu on a host without a TPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import (
    PROGRAMS,
    Program,
    activation_differences,
    golden_table,
    layout_rows,
    paired,
    unanswered,
)
from conformance.contract import Remat, declared
from conformance.core.failure import fail_if_any
from conformance.core.records import Layouts, emit
from conformance.core.tpu import TpuCompile
from conformance.runtime.aot import batch_rows, traced_as_production
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.sides import live_pair

SHOWN = 6
"""Differing values a report lists, in Linen's call order; the rest are counted."""

_CAUSE = (
    "likely cause: a partitioning change, not a numeric one: an activation constraint "
    "(nn.with_logical_constraint, jax.lax.with_sharding_constraint) that one side applies "
    "and the other does not, or applies under another logical name, in another axis "
    "order or to another tensor; the numbers agree either way, the collectives and "
    "memory do not"
)


def _collectives(found: dict[str, tuple[int, int]]) -> str:
    if not found:
        return "none"
    return ", ".join(f"{kind} x{count} ({size} B)" for kind, (count, size) in found.items())


def _problems(program: Program, case: Case, rows: int) -> tuple[list[str], str, dict[str, Any]]:
    """``program``'s differences in words, its one-line count, and the second side's table."""
    a, b = live_pair(case)
    paired(a, b)
    names = (a.name, b.name)
    laid_out, asked, first, second = activation_differences(a, b, a.path_rules(), program, rows)
    mesh = dict(second.mesh)
    emit(Layouts(program.name, layout_rows(second, laid_out)))
    problems = unanswered(first, second, names)
    problems += [d.describe(mesh, names) for d in laid_out[:SHOWN]]
    if len(laid_out) > SHOWN:
        problems.append(f"... and {len(laid_out) - SHOWN} more value(s) laid out differently")
    problems += [d.describe(names) for d in asked[:SHOWN]]
    if len(asked) > SHOWN:
        problems.append(f"... and {len(asked) - SHOWN} more module(s) constraining differently")
    if asked and not laid_out:
        problems.append(
            "the compiled layouts agree on this mesh: the compiler made up for the "
            "difference here; it need not at another mesh, size or XLA release"
        )
    if problems:
        problems.append(
            f"collectives: {names[0]} {_collectives(dict(first.collectives))}; "
            f"{names[1]} {_collectives(dict(second.collectives))}"
        )
    count = (
        f"{program.name}: {len(laid_out)} value(s) laid out differently, "
        f"{len(asked)} module(s) constraining differently"
    )
    return [f"{program.name}: {p}" for p in problems], count, golden_table(second)


def _compared(
    case: Case, where: str, rows: int = BATCH_SIZE, step: Case | None = None
) -> dict[str, Any]:
    """Both sides' forward and train step (of ``step``, default ``case``), compared.

    Returns the second side's tables of both as the golden.
    """
    problems, counts, tables = [], [], {}
    forward, train_step = PROGRAMS
    for program, on in ((forward, case), (train_step, step or case)):
        found, count, tables[program.name] = _problems(program, on, rows)
        problems += found
        counts += [count] if found else []
    if problems:
        problems.append(_CAUSE)
    fail_if_any(
        f"activation shardings differ ({case.layout} layout, {where}): " + "; ".join(counts),
        problems,
    )
    return {"mesh": case.mesh.sizes(), **tables}


@declare((*ON_MESH, Axis.PAIR), golden=True, golden_by_platform=True, costly_pairs=True)
def check_activation_sharding(case: Case) -> dict[str, Any]:
    """Every paired module call's values are sharded alike in both forwards and train steps.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis),
    which have no golden of their own.

    Each side's forward and train step are compiled for the case's mesh with probes
    (:mod:`conformance.runtime.activations`); modules pair as localisation pairs them.
    In the forward, the sharding constraints each paired module asks for must agree
    too, over its subtree (:func:`~conformance.checks.kernel.constraint_differences`;
    a step adds what each backend's autodiff transposes). A failure names the first
    values, in Linen's call order, whose sharding differs, with both specs and the
    shards they split each dimension in, the modules that constrain differently, and
    both programs' collectives. Returns the second side's call-by-call tables of both
    programs as the golden (kept per platform, XLA level and mesh: the partitioner
    decides it).
    """
    return _compared(case, f"mesh {case.mesh}")


@declare(
    (Axis.FAMILY, Axis.TPU),
    name="activation_sharding_tpu",
    where="tpu",
    devices=False,
    golden=True,
    given=(Axis.TPU,),
    costly_production=True,
)
def check_activation_sharding_tpu(case: Case, tpu: TpuCompile) -> dict[str, Any]:
    """:func:`check_activation_sharding` for ``tpu``'s slice, compiled by libtpu.

    The forward and train step of one row per chip
    (:func:`~conformance.runtime.aot.batch_rows`), at the target's size: the device size
    on a small slice, each production size on a production one, traced at jax's default
    matmul precision and, for a family with remat, rematerialised, as production trains.
    Nothing is allocated or run. The golden is kept per topology and libtpu version.
    """
    where = f"TPU {tpu.target.topology.name}, mesh {tpu.target.mesh.id}, size {case.size}"
    step = case
    if case.size != case.family.device_size and (remat := declared(case.family, Remat)):
        step = case.with_config(remat.config(case.config))
    with traced_as_production() if tpu.target.production else contextlib.nullcontext():
        return _compared(case, where, batch_rows(case), step)
