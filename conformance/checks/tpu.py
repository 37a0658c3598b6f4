"""Compiled-program parity for a TPU slice, on a host without a TPU: cost, and fit.

Each side's forward, train step (as production trains: rematerialised, for a family
with remat, at production sizes) and one decode call are lowered with abstract
arguments on a mesh of the slice's devices (:mod:`conformance.runtime.aot`; at a
production size, at jax's default matmul precision, as production traces them) and
compiled by libtpu with XLA's default optimisations. Nothing is allocated or run. The
programs are held to the ``cost`` check's budget
(:func:`~conformance.core.cost.over_budget`), and each must fit the chip: arguments,
outputs, temporaries and generated code within its HBM
(:data:`~conformance.core.tpu.HBM_GIB`). The outputs the compiler places (the forward's
logits and hidden states, the step's gradients and loss, the decode call's logits) must
come out sharded alike on both sides, leaf by leaf, and so must every leaf the program
takes in and keeps (the parameters, the train state, the KV cache, the batch), read
back from the executable, an argument one side never reads included. The failures
that only exist at real size on the real compiler show here: a read-only parameter
stacked per layer, a step that lost remat, a kernel sharded on other mesh axes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax

from conformance.checks.declare import Axis, declare
from conformance.contract import Remat, declared, supports
from conformance.core.cost import Cost, cost_of, over_budget
from conformance.core.failure import fail_if_any
from conformance.core.records import Costs, emit
from conformance.core.tpu import TpuCompile, libtpu_version
from conformance.runtime.aot import (
    NOT_READ,
    Program,
    abstract_batch,
    batch_rows,
    compile_for_production,
    held,
    lowered_decode_step,
    lowered_forward,
    lowered_train_step,
    placements,
    traced_as_production,
)
from conformance.runtime.case import Case
from conformance.runtime.sides import Side, live_pair

GIB = 2**30


class Refused(Exception):
    """libtpu refused to compile a program; the message is its first line."""


class DoesNotFit(Refused):
    """libtpu refused to compile a program: it needs more memory than the chip has."""


def compiled_for(lowered: jax.stages.Lowered) -> Any:
    """``lowered`` compiled as production compiles it; :class:`Refused` when libtpu refuses.

    :class:`DoesNotFit` when for want of memory; any other refusal (a Pallas kernel that
    Mosaic cannot lower, say) is a :class:`Refused` with libtpu's first line.
    """
    try:
        return compile_for_production(lowered)
    except jax.errors.JaxRuntimeError as err:
        first = str(err).splitlines()[0]
        raise (DoesNotFit if "RESOURCE_EXHAUSTED" in first else Refused)(first) from None


def _footprint(compiled: Any) -> int:
    """Bytes a compiled program needs per device: arguments, outputs, temporaries, code."""
    memory = compiled.memory_analysis()
    return sum(
        int(getattr(memory, field, 0))
        for field in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
        )
    )


def _programs(case: Case) -> dict[str, list[tuple[Side, Program]]]:
    """``{program: [(side, lowered), ...]}``: each side's programs, Linen first.

    The forward, the train step(s) and, for a family that decodes, one decode call (a
    token per row against a cache of the family's length). At the device size both
    train steps, plain and (with remat) rematerialised, as the ``cost`` check compiles
    them; at a production size only the step production runs: rematerialised when the
    family has remat.
    """
    remat = declared(case.family, Remat)
    variants: dict[str, Case] = {}
    if case.size == case.family.device_size or remat is None:
        variants["train_step"] = case
    if remat is not None:
        variants["train_step (remat)"] = case.with_config(remat.config(case.config))
    rows = batch_rows(case)
    batch = abstract_batch(case, rows)
    found = {"forward": [(side, lowered_forward(side, batch)) for side in live_pair(case)]}
    for name, variant in variants.items():
        found[name] = [(side, lowered_train_step(side, batch)) for side in live_pair(variant)]
    if supports(case.family, "decode"):
        found["decode_step"] = [(side, lowered_decode_step(side, rows)) for side in live_pair(case)]
    return found


_PLACED = (
    "placed by the compiler",
    "a parameter or activation sharded differently: a layout the next program pays for "
    "in collectives",
)
_HELD = (
    "held by the program",
    "annotated or resolved differently: the sharding, optimizer_sharding and "
    "decode_cache checks name both sides' logical axes",
)
_UNREAD = "one side's program never reads it: an input its model ignores"


def _apart(program: str, found: dict[Side, dict[str, Any]], how: tuple[str, str]) -> list[str]:
    """Each leaf ``found`` sharded differently on the two sides, with ``how`` it came so.

    ``how`` is :data:`_PLACED` or :data:`_HELD`: what the shardings are, and the likely
    cause when they differ (for a held leaf one side never reads, that it ignores it).
    """
    (first, ours), (second, theirs) = found.items()
    verb, cause = how
    missing = "(no such leaf)"
    problems = []
    for path in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(path, missing), theirs.get(path, missing)
        if a != b:
            why = _UNREAD if NOT_READ in (a, b) else cause
            problems.append(
                f"{program}: {path} {verb} as {first.name} {a} but {second.name} {b} ({why})"
            )
    return problems


def _not_fitting(side: Side, program: str, tpu: TpuCompile, footprint: int) -> str:
    topology = tpu.target.topology
    hbm = topology.hbm_bytes
    return (
        f"{side.name} {program} does not fit a {topology.generation} chip: "
        f"{footprint / GIB:.2f} GiB per device, {(footprint - hbm) / GIB:.2f} GiB over its "
        f"{hbm / GIB:.0f} GiB of HBM ({footprint / hbm:.0%})"
    )


@declare((Axis.FAMILY, Axis.TPU), where="tpu", devices=False, golden=True, given=(Axis.TPU,))
def check_tpu_compile(case: Case, tpu: TpuCompile) -> dict[str, Any]:
    """Linen's and NNX's programs compiled for ``tpu``'s slice cost alike, and both fit.

    Per program (forward, train step, decode call): NNX within the ``cost`` check's
    budget of Linen's (flops, bytes accessed, argument, output and temporary memory,
    collectives by kind); the outputs the compiler places sharded alike, leaf by leaf;
    every leaf the program takes in and keeps (the parameters, the train state, the KV
    cache, the batch), read back from the executable, sharded alike, an argument one
    side never reads named so; and each side's footprint per device (arguments,
    outputs, temporaries and generated code) within the chip's HBM. A program libtpu
    refuses for want of memory fails naming the side, the program and the compiler's
    figure; one it refuses otherwise (a Pallas kernel Mosaic cannot lower) fails with
    libtpu's first line. Returned as the golden, kept per topology, libtpu version and
    XLA level: every program's costs, footprint and placed shardings (the held ones
    come from the logical names, which the ``sharding``, ``optimizer_sharding`` and
    ``decode_cache`` goldens keep).
    """
    topology = tpu.target.topology
    programs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    with traced_as_production() if tpu.target.production else contextlib.nullcontext():
        lowered = _programs(case)
    for name, sides in lowered.items():
        costs: list[Cost] = []
        tables: dict[str, dict[str, Any]] = {}
        placed: dict[Side, dict[str, Any]] = {}
        kept: dict[Side, dict[str, Any]] = {}
        for side, program in sides:
            try:
                compiled = compiled_for(program.lowered)
            except DoesNotFit as err:
                chip = topology.generation
                problems.append(f"{side.name} {name} does not fit a {chip} chip: {err}")
                continue
            except Refused as err:
                problems.append(f"libtpu cannot compile {side.name}'s {name}: {err}")
                continue
            costs.append(cost := cost_of(compiled))
            footprint = _footprint(compiled)
            tables[side.backend] = {
                **cost.table(),
                "footprint_bytes": footprint,
                "hbm_bytes": topology.hbm_bytes,
            }
            placed[side] = placements(side, program, compiled)
            try:
                kept[side] = held(side, program, compiled)
            except LookupError as err:
                problems.append(f"{name}: {err}")
            if footprint > topology.hbm_bytes:
                problems.append(_not_fitting(side, name, tpu, footprint))
        programs[name] = {
            side.backend: tables[side.backend] | {"placed": {p: {"spec": s} for p, s in by.items()}}
            for side, by in placed.items()
        }
        if len(costs) == len(sides) == 2:
            emit(Costs(f"{name} on {topology.name}", tables))
            problems += over_budget(name, *costs, scanned=case.scan_layers)
            problems += _apart(name, placed, _PLACED)
        if len(kept) == len(sides) == 2:
            problems += _apart(name, kept, _HELD)
    fail_if_any(
        f"compiled for TPU {topology.name} (mesh {tpu.target.mesh.id}, size {case.size})",
        problems,
    )
    return {
        "topology": topology.name,
        "mesh": tpu.target.mesh.id,
        "size": case.size,
        "libtpu": libtpu_version(),
        "programs": programs,
    }
