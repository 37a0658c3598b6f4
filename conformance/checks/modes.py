"""Two modes of one backend: NNX in graph against tree mode, on auto against explicit axes.

flax plans NNX's tree mode as its default (``nnx_graph_mode=False``,
``nnx_graph_updates=False``). A zoo moving to it may rewrite code tree mode cannot run
(shared references), and each rewrite can diverge silently, as the Linen rewrite could.
The ``tree_mode`` check holds the family's NNX model in graph mode and the same model
(or the rewrite it declares, :class:`~conformance.contract.TreeMode`) in tree mode to the
same parameters, forward, train steps and checkpoints.

jax's explicit sharding mode makes shardings part of array types: a model written for
auto axes can fail there, or be rewritten to lay its activations out differently. The
``explicit_sharding`` check holds the family's NNX model on auto axes and the same model
(or the rewrite it declares, :class:`~conformance.contract.ExplicitSharding`) on the
same devices with explicit axes to the same parameters, forward, train step and
activation layouts.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

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
from conformance.core.distributed import host_array
from conformance.core.failure import CheckFailure, fail, fail_if_any
from conformance.core.numerics import compare_trees, tolerance_for
from conformance.core.records import failed
from conformance.core.trees import Flat
from conformance.runtime.activations import Table
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.checkpoints import CheckpointInfo, save
from conformance.runtime.modes import (
    NnxExplicitSide,
    NnxTreeSide,
    explicit_sharding,
    shared_references,
    tree_mode,
)
from conformance.runtime.sides import NnxSide, Side
from conformance.runtime.stepping import StepResult, Training
from conformance.runtime.train_state import flat_state

GRAPH, TREE = "NNX graph mode", NnxTreeSide.name
MODES = (GRAPH, TREE)
AUTO, EXPLICIT = "NNX auto sharding", NnxExplicitSide.name
SHARDING_MODES = (AUTO, EXPLICIT)
SHOWN = 6
"""Values laid out differently a report lists per program, in call order; the rest are counted."""


Layout = tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]
"""What a side builds: parameter specs, logical axis names, and values held beside them."""


def _layout(side: Side) -> Layout:
    runner = side.runner
    return runner.specs, runner.logical, runner.held


def _layout_differences(
    graph: Layout,
    tree: Layout,
    modes: tuple[str, str] = ("graph mode", "tree mode"),
    accepted: Collection[str] = (),
) -> list[str]:
    """Every parameter or held value the two ``modes`` build differently, a line each.

    A parameter of the second mode only that is ``accepted`` is not a difference.
    """
    problems = []
    kinds = ("parameter", "logical axis names", "held beside the parameters")
    one, other = modes
    for what, first, second in zip(kinds, graph, tree, strict=True):
        for path in sorted(set(first) | set(second)):
            if path not in second:
                problems.append(f"{path}: {what} {first[path]} in {one} only")
            elif path not in first:
                if path not in accepted:
                    problems.append(f"{path}: {what} {second[path]} in {other} only")
            elif first[path] != second[path]:
                both = f"{first[path]} in {one}, {second[path]} in {other}"
                problems.append(f"{path}: {what} {both}")
    return problems


def _accepted(case: Case, graph: Layout, tree: Layout) -> dict[str, str]:
    """The parameters the family accepts in tree mode only, each with its graph-mode source.

    Fails naming each entry of ``TreeMode(accept=...)`` that is not a parameter of tree
    mode only, or whose source is not a graph-mode parameter of its shape and dtype.
    """
    entries = required(case.family, TreeMode).accept
    if not all(_is_pair(entry) for entry in entries):
        fail(f"TreeMode(accept=...) takes (path, source) pairs of strings, not {entries!r}")
    accept = dict(entries)
    (graph_specs, _, _), (tree_specs, _, _) = graph, tree
    counts = Counter(path for path, _ in entries)
    problems = [f"{path}: accepted {n} times" for path, n in counts.items() if n > 1]
    for path, source in accept.items():
        if path in graph_specs or path not in tree_specs:
            problems.append(f"{path}: accepted as a parameter of tree mode only, which it is not")
        elif graph_specs.get(source) != tree_specs[path]:
            held = graph_specs.get(source, "nothing")
            problems.append(f"{path}: {tree_specs[path]} cannot start as {source}: {held}")
    fail_if_any(f"TreeMode(accept=...) of {case.family.name} does not fit the rewrite", problems)
    return accept


def _is_pair(entry: Any) -> bool:
    return isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(p, str) for p in entry)


def _in_tree_mode(
    case: Case, graph: Layout, params: Flat, checkpoint: tuple[Path, Flat], workdir: Path
) -> tuple[Any, StepResult, tuple[StepResult, Flat] | None]:
    """Tree mode's logits, first step from ``params``, and step resumed from ``checkpoint``.

    ``graph`` is what graph mode built; ``checkpoint`` is graph mode's: its directory and
    the state saved there. Tree mode's own state after its first step is saved under
    ``workdir/tree`` and returned beside the resumed step; with accepted parameters
    (``TreeMode(accept=...)``) the checkpoints are not exchanged, and ``None`` is
    returned in their place. Run inside :func:`~conformance.runtime.modes.tree_mode`:
    any side used here is built there.
    """
    tree, batch = NnxTreeSide.of(case), case.batch()
    built = _layout(tree)
    accepted = _accepted(case, graph, built)
    fail_if_any(
        f"{TREE} builds the model differently from {GRAPH}",
        _layout_differences(graph, built, accepted=accepted),
    )
    own = tree.own(params)
    logits = host_array(tree.forward(tree.place(own), batch)[0])
    training = Training.start(tree, own)
    first = training.advance(batch)
    if accepted:
        return logits, first, None
    state = flat_state(training.state)
    save(workdir / "tree", state, _info(case))
    resumed = Training.start(tree, params)
    restored_into(*checkpoint, resumed, f"{GRAPH}'s checkpoint of step 1 read in tree mode")
    return logits, first, (resumed.advance(batch), state)


@contextlib.contextmanager
def _raised_as(case: Case, mode: str, other: str) -> Iterator[None]:
    """An exception raised inside (not a check's own failure) reported as ``mode``'s."""
    try:
        yield
    except CheckFailure:
        raise
    except Exception as err:
        fail(raised.mode_report(err, case.family, mode, other))


def _same_forward_and_step(
    case: Case, one: tuple[Any, StepResult], other: tuple[Any, StepResult], modes: tuple[str, str]
) -> None:
    """Both modes' logits and first train steps agree, as ``(logits, step)`` of each."""
    (logits, first), (theirs, their_first) = one, other
    if mismatches := compare_trees(
        {"logits": logits}, {"logits": theirs}, tolerance_for(case.dtype)
    ):
        fail(failed(f"forward on mesh {case.mesh.id}", mismatches, modes))
    steps_agree(f"one train step on mesh {case.mesh.id}", first, their_first, modes)


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
    """The NNX model in tree mode agrees with itself in graph mode.

    The model in tree mode is the rewrite the family declares for it
    (:class:`~conformance.contract.TreeMode`), or its own NNX module. Both modes build the
    same parameters (paths, shapes, dtypes, logical axis names) and held values; from the
    same parameters they give the same logits and the same first train step (loss,
    gradients, next state, persistent state included); and each reads the other's
    checkpoint strictly: tree mode resumes from graph mode's state after one step and
    takes the same second step, and graph mode restores tree mode's state byte for byte.
    A model with shared references, which tree mode cannot hold, fails naming them,
    unless the family declares its rewrite. Parameters the rewrite holds on purpose where
    graph mode held none (``TreeMode(accept=...)``) start as copies of the graph-mode
    parameters named; the forward and train step are compared on every other leaf, and
    the checkpoints, whose trees then differ, are not exchanged.
    """
    graph, batch = NnxSide(case), case.batch()
    rewritten = required(case.family, TreeMode).nnx_module is not None
    if (shared := shared_references(graph.runner.abstract)) and not rewritten:
        fail(
            f"{GRAPH} holds shared references, which tree mode cannot hold: "
            + "; ".join(found.describe() for found in shared)
            + ". Declare the model rewritten without them as TreeMode(nnx_module=...)"
        )
    params = graph.init(0)
    logits = host_array(graph.forward(params, batch)[0])
    straight = Training.start(graph, params)
    first = straight.advance(batch)
    checkpoint = (workdir / "graph", flat_state(straight.state))
    save(*checkpoint, _info(case))
    second = straight.advance(batch)
    built = _layout(graph)
    with _raised_as(case, TREE, GRAPH), tree_mode():
        tree_logits, tree_first, exchanged = _in_tree_mode(case, built, params, checkpoint, workdir)
    _same_forward_and_step(case, (logits, first), (tree_logits, tree_first), MODES)
    if exchanged is None:
        return
    resumed, tree_state = exchanged
    steps_agree(f"step 2, tree mode resumed from {GRAPH}'s checkpoint", second, resumed, MODES)
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
    """The NNX model on explicit mesh axes agrees with itself on auto axes.

    The model on explicit axes is the rewrite the family declares for them
    (:class:`~conformance.contract.ExplicitSharding`), or its own NNX module, traced with
    the case's mesh made explicit and set in context (``jax.set_mesh``). Both build the
    same parameters (paths, shapes, dtypes, logical axis names) and held values; from
    the same parameters they give the same logits and the same first train step; and
    their compiled forwards lay the values of every module call both make alike. An
    exception raised on explicit axes alone (jax refusing an ambiguous sharding) is
    reported as the explicit side's.
    """
    auto, batch = NnxSide(case), case.batch()
    params = auto.init(0)
    logits = host_array(auto.forward(params, batch)[0])
    first = Training.start(auto, params).advance(batch)
    built, table = _layout(auto), FORWARD.table(auto, BATCH_SIZE)
    with _raised_as(case, EXPLICIT, AUTO), explicit_sharding(case) as on_explicit:
        explicit = NnxExplicitSide.of(on_explicit)
        fail_if_any(
            f"{EXPLICIT} builds the model differently from {AUTO}",
            _layout_differences(built, _layout(explicit), ("auto axes", "explicit axes")),
        )
        explicit_batch = on_explicit.batch()
        theirs = host_array(explicit.forward(explicit.place(params), explicit_batch)[0])
        their_first = Training.start(explicit, params).advance(explicit_batch)
        their_table = FORWARD.table(explicit, BATCH_SIZE)
    _same_forward_and_step(case, (logits, first), (theirs, their_first), SHARDING_MODES)
    fail_if_any(
        f"activation layouts differ on mesh {case.mesh.id}",
        _layout_problems(case, table, their_table),
    )
