"""Two modes of one backend: NNX in graph against tree mode, on auto against explicit axes.

flax plans NNX's tree mode as its default (``nnx_graph_mode=False``,
``nnx_graph_updates=False``). A zoo moving to it may rewrite code tree mode cannot run
(shared references), and each rewrite can diverge silently, as the Linen rewrite could.
The ``tree_mode`` check holds the family's NNX model in graph mode and the same model
(or the rewrite it declares, :class:`~conformance.contract.TreeMode`) in tree mode to
each other's checkpoints, and graph mode to holding no shared reference.

jax's explicit sharding mode makes shardings part of array types: a model written for
auto axes can fail there, or be rewritten to lay its activations out differently. The
``explicit_sharding`` check holds the family's NNX model on auto axes and the same model
(or the rewrite it declares, :class:`~conformance.contract.ExplicitSharding`) on the
same devices with explicit axes to the same activation layouts.

What each builds (``structure``, ``sharding``), their initial values, forward, train
steps, decoding and compiled costs are compared by those checks on the
``graph-vs-tree`` and ``auto-vs-explicit`` pairs (:class:`~conformance.contract.Pair`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from conformance.checks import raised
from conformance.checks.declare import Axis, declare
from conformance.checks.kernel import (
    PROGRAMS,
    compare_tables,
    restored_into,
    steps_agree,
    unanswered,
)
from conformance.contract import Backend, TreeMode, required
from conformance.core.failure import CheckFailure, fail, fail_if_any
from conformance.runtime.activations import Table
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.checkpoints import CheckpointInfo, save
from conformance.runtime.modes import (
    NnxAutoSide,
    NnxExplicitSide,
    NnxGraphSide,
    NnxTreeSide,
    accepted,
    shared_references,
)
from conformance.runtime.sides import NnxSide, Side
from conformance.runtime.stepping import Training
from conformance.runtime.train_state import flat_state

GRAPH, TREE = NnxGraphSide.name, NnxTreeSide.name
MODES = (GRAPH, TREE)
AUTO, EXPLICIT = NnxAutoSide.name, NnxExplicitSide.name
SHARDING_MODES = (AUTO, EXPLICIT)
SHOWN = 6
"""Values laid out differently a report lists per program, in call order; the rest are counted."""


def _accepted(case: Case, graph: Side, tree: Side) -> dict[str, str]:
    """The parameters the family accepts in tree mode only, each with its graph-mode source.

    Fails on malformed entries of ``TreeMode(accept=...)``, and naming each that is not a
    parameter of tree mode only, or whose source is not a graph-mode parameter of its
    shape and dtype.
    """
    try:
        accept = accepted(case.family)
    except ValueError as err:
        fail(str(err))
    graph_specs, tree_specs = graph.runner.specs, tree.runner.specs
    problems = []
    for path, source in accept.items():
        if path in graph_specs or path not in tree_specs:
            problems.append(f"{path}: accepted as a parameter of tree mode only, which it is not")
        elif graph_specs.get(source) != tree_specs[path]:
            held = graph_specs.get(source, "nothing")
            problems.append(f"{path}: {tree_specs[path]} cannot start as {source}: {held}")
    fail_if_any(f"TreeMode(accept=...) of {case.family.name} does not fit the rewrite", problems)
    return accept


@contextlib.contextmanager
def _raised_as(case: Case, mode: str, other: str) -> Iterator[None]:
    """An exception raised inside (not a check's own failure) reported as ``mode``'s."""
    try:
        yield
    except CheckFailure:
        raise
    except Exception as err:
        fail(raised.mode_report(err, case.family, mode, other))


def _info(case: Case) -> CheckpointInfo:
    return CheckpointInfo(case.family.name, case.size, Backend.NNX, case.scan_layers)


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS),
    where="primary",
    capability="tree_mode",
    workdir=True,
    pair=False,
    mode_pair=True,
)
def check_tree_mode(case: Case, workdir: Path) -> None:
    """Graph mode holds nothing tree mode cannot, and each mode reads the other's checkpoints.

    The model in tree mode is the rewrite the family declares for it
    (:class:`~conformance.contract.TreeMode`), or its own NNX module. Each mode reads the
    other's checkpoint strictly: tree mode resumes from graph mode's state after one step
    and takes the same second step, and graph mode restores tree mode's state after one
    step byte for byte. A model with shared references, which tree mode cannot hold,
    fails naming them, unless the family declares its rewrite. Parameters the rewrite
    holds on purpose where graph mode held none (``TreeMode(accept=...)``) must be
    parameters of tree mode only, each of the shape of the graph-mode parameter it starts
    as; the checkpoints, whose trees then differ, are not exchanged. What the two modes
    build, their initial values, forward, train steps, decoding and costs are compared by
    those checks on the ``graph-vs-tree`` pair (``structure``, ``sharding``, ``init``, ...).
    """
    graph, tree = NnxGraphSide(case), NnxTreeSide.of(case)
    rewritten = required(case.family, TreeMode).nnx_module is not None
    if (shared := shared_references(graph.runner.abstract)) and not rewritten:
        fail(
            f"{GRAPH} holds shared references, which tree mode cannot hold: "
            + "; ".join(found.describe() for found in shared)
            + ". Declare the model rewritten without them as TreeMode(nnx_module=...)"
        )
    with _raised_as(case, TREE, GRAPH):
        if _accepted(case, graph, tree):
            return
    params, batch = graph.init(0), case.batch()
    straight = Training.start(graph, params)
    straight.advance(batch)
    checkpoint = (workdir / "graph", flat_state(straight.state))
    save(*checkpoint, _info(case))
    second = straight.advance(batch)
    with _raised_as(case, TREE, GRAPH):
        own = Training.start(tree, params)
        own.advance(batch)
        tree_state = flat_state(own.state)
        save(workdir / "tree", tree_state, _info(case))
        resumed = Training.start(tree, params)
        restored_into(*checkpoint, resumed, f"{GRAPH}'s checkpoint of step 1 read in tree mode")
        their_second = resumed.advance(batch)
    steps_agree(f"step 2, tree mode resumed from {GRAPH}'s checkpoint", second, their_second, MODES)
    back = Training.start(graph, params)
    restored_into(workdir / "tree", tree_state, back, f"{TREE}'s checkpoint read in graph mode")


_LAYOUT_CAUSE = (
    "likely cause: a partitioning change, not a numeric one: the explicit side lays this "
    "value out as its own code says (jax.sharding.reshard, an out_sharding, a gathered "
    "weight) and the auto side as the compiler chose from its sharding constraints; the "
    "numbers agree either way, the collectives and memory do not"
)


FORWARD = next(program for program in PROGRAMS if program.name == "forward")
"""The program whose layouts the modes are compared by: on explicit axes a value's
layout is part of its type, fixed where it is traced, so a train step's forward lays
its values out as the forward does."""


def _layout_problems(case: Case, auto: Table, explicit: Table) -> list[str]:
    """Every module call value the explicit side's forward lays out otherwise, in words."""
    same = {call.path: call.path for call in auto.calls}
    laid_out = compare_tables(auto, explicit, same)
    problems = unanswered(auto, explicit, SHARDING_MODES) + [
        d.describe(case.mesh.sizes(), SHARDING_MODES) for d in laid_out[:SHOWN]
    ]
    if len(laid_out) > SHOWN:
        problems.append(f"... and {len(laid_out) - SHOWN} more value(s) laid out differently")
    return [*(f"{FORWARD.name}: {line}" for line in problems), _LAYOUT_CAUSE] if problems else []


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS),
    where="primary",
    capability="explicit_sharding",
    pair=False,
    mode_pair=True,
)
def check_explicit_sharding(case: Case) -> None:
    """The NNX model on explicit mesh axes lays its values out as on auto axes.

    The model on explicit axes is the rewrite the family declares for them
    (:class:`~conformance.contract.ExplicitSharding`), or its own NNX module, traced with
    the case's mesh made explicit and set in context (``jax.set_mesh``). Their compiled
    forwards lay the values of every module call both make alike. An exception raised on
    explicit axes alone (jax refusing an ambiguous sharding) is reported as the explicit
    side's. What the two build, their initial values, forward, train steps, decoding and
    costs are compared by those checks on the ``auto-vs-explicit`` pair (``sharding``,
    ``init``, ...).
    """
    auto, explicit = NnxSide(case), NnxExplicitSide.of(case)  # auto: activation_sharding's table
    table = FORWARD.table(auto, BATCH_SIZE)
    with _raised_as(case, EXPLICIT, AUTO):
        their_table = FORWARD.table(explicit, BATCH_SIZE)
    fail_if_any(
        f"activation layouts differ on mesh {case.mesh.id}",
        _layout_problems(case, table, their_table),
    )
