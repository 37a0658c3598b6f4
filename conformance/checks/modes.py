"""Two modes of one backend compared: NNX in graph mode against NNX in tree mode.

flax plans NNX's tree mode as its default (``nnx_graph_mode=False``,
``nnx_graph_updates=False``). A zoo moving to it may rewrite code tree mode cannot run
(shared references), and each rewrite can diverge silently, as the Linen rewrite could.
The ``tree_mode`` check holds the family's NNX model in graph mode and the same model
(or the rewrite it declares, :class:`~conformance.contract.TreeMode`) in tree mode to the
same parameters, forward, train steps and checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conformance.checks import raised
from conformance.checks.declare import Axis, declare
from conformance.checks.kernel import restored_into, steps_agree
from conformance.contract import Backend, TreeMode, required
from conformance.core.distributed import host_array
from conformance.core.failure import CheckFailure, fail, fail_if_any
from conformance.core.numerics import compare_trees, tolerance_for
from conformance.core.records import failed
from conformance.core.trees import Flat
from conformance.runtime.case import Case
from conformance.runtime.checkpoints import CheckpointInfo, save
from conformance.runtime.modes import NnxTreeSide, shared_references, tree_mode
from conformance.runtime.sides import NnxSide, Side
from conformance.runtime.stepping import StepResult, Training
from conformance.runtime.train_state import flat_state

GRAPH, TREE = "NNX graph mode", NnxTreeSide.name
MODES = (GRAPH, TREE)


Layout = tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]
"""What a side builds: parameter specs, logical axis names, and values held beside them."""


def _layout(side: Side) -> Layout:
    runner = side.runner
    return runner.specs, runner.logical, runner.held


def _layout_differences(graph: Layout, tree: Layout) -> list[str]:
    """Every parameter or held value the two modes build differently, a line each."""
    problems = []
    kinds = ("parameter", "logical axis names", "held beside the parameters")
    for what, first, second in zip(kinds, graph, tree, strict=True):
        for path in sorted(set(first) | set(second)):
            if path not in second:
                problems.append(f"{path}: {what} {first[path]} in graph mode only")
            elif path not in first:
                problems.append(f"{path}: {what} {second[path]} in tree mode only")
            elif first[path] != second[path]:
                both = f"{first[path]} in graph mode, {second[path]} in tree mode"
                problems.append(f"{path}: {what} {both}")
    return problems


def _in_tree_mode(
    case: Case, graph: Layout, params: Flat, checkpoint: tuple[Path, Flat], workdir: Path
) -> tuple[Any, StepResult, StepResult, Flat]:
    """Tree mode's logits, first step from ``params``, and step resumed from ``checkpoint``.

    ``graph`` is what graph mode built; ``checkpoint`` is graph mode's: its directory and
    the state saved there. Tree mode's own state after its first step is saved under
    ``workdir/tree`` and returned last. Run inside
    :func:`~conformance.runtime.modes.tree_mode`: any side used here is built there.
    """
    tree, batch = NnxTreeSide.of(case), case.batch()
    fail_if_any(
        f"{TREE} builds the model differently from {GRAPH}",
        _layout_differences(graph, _layout(tree)),
    )
    logits = host_array(tree.forward(tree.place(params), batch)[0])
    training = Training.start(tree, params)
    first = training.advance(batch)
    state = flat_state(training.state)
    save(workdir / "tree", state, _info(case))
    resumed = Training.start(tree, params)
    restored_into(*checkpoint, resumed, f"{GRAPH}'s checkpoint of step 1 read in tree mode")
    return logits, first, resumed.advance(batch), state


def _info(case: Case) -> CheckpointInfo:
    return CheckpointInfo(case.family.name, case.size, Backend.NNX, case.scan_layers)


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS),
    where="primary",
    capability="tree_mode",
    workdir=True,
    pair=False,
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
    unless the family declares its rewrite.
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
    try:
        with tree_mode():
            tree_logits, tree_first, resumed, tree_state = _in_tree_mode(
                case, built, params, checkpoint, workdir
            )
    except CheckFailure:
        raise
    except Exception as err:
        fail(raised.mode_report(err, case.family, TREE, GRAPH))
    tolerance = tolerance_for(case.dtype)
    if mismatches := compare_trees({"logits": logits}, {"logits": tree_logits}, tolerance):
        fail(failed(f"forward on mesh {case.mesh.id}", mismatches, MODES))
    steps_agree(f"one train step on mesh {case.mesh.id}", first, tree_first, MODES)
    steps_agree(f"step 2, tree mode resumed from {GRAPH}'s checkpoint", second, resumed, MODES)
    back = Training.start(graph, params)
    restored_into(workdir / "tree", tree_state, back, f"{TREE}'s checkpoint read in graph mode")
