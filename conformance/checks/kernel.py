"""The comparison kernel every check is built on: sides, shared parameters, train steps.

A check compares two sides of a case (:mod:`conformance.runtime.sides`): it gives them
the same parameters (:func:`shared_params`), runs both, and compares what they computed,
keyed by canonical paths, under the tolerance policy. When a comparison on a mesh fails,
the same two computations on one device say which side moved (:func:`attributed`).
Check modules import this module and nothing else of ``conformance.checks``; failures
are raised with :func:`~conformance.core.failure.fail`, headed by the check that runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from conformance.contract import LogicalRules
from conformance.core.distributed import host_array
from conformance.core.environment import nondeterminism
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import (
    EXACT,
    Mismatch,
    Tolerance,
    compare_arrays,
    compare_trees,
    report,
)
from conformance.core.records import emit, emit_verdict, failed, listening, measure
from conformance.core.rounding import NUDGE_SEEDS, RoundingVerdict, one_ulp_nudge, rounding_verdict
from conformance.core.sharding import Logical, indivisible, spec_to_json
from conformance.core.trees import Flat, LeafSpec, PathMapError, check_bijection
from conformance.runtime.backends import TransplantError
from conformance.runtime.case import Case
from conformance.runtime.checkpoints import CheckpointError, CheckpointInfo, restore, save
from conformance.runtime.diagnose.attribution import Pair, attribution_text, noise_masked
from conformance.runtime.sides import Side, live_pair
from conformance.runtime.stepping import StepResult, Training

STEPS = 3
"""Train steps compared for parity."""


def compared(
    title: str,
    first: Any,
    second: Any,
    *,
    names: tuple[str, str] = ("Linen", "NNX"),
    tolerance: Tolerance | None = None,
    figure: str = "",
    series: str = "",
    x: str = "",
) -> Mismatch | None:
    """Two sides' logits compared under the policy (or ``tolerance``), and measured.

    The comparison every logits check makes: :func:`~conformance.core.numerics.compare_arrays`
    of the leaf ``logits``, emitted as a measurement titled ``title`` (at ``x`` of line
    ``series`` in plot ``figure``) for the report. Returns the mismatch, if any.
    """
    found = compare_arrays("logits", first, second, tolerance)
    plot = {"figure": figure, "series": series, "x": x}
    emit_verdict(title, "logits", first, second, found, names=names, tolerance=tolerance, **plot)
    return found


def param_map(first: Side, second: Side) -> dict[str, str]:
    """``{first's parameter path: second's}``, checked to be a bijection (else a failure)."""
    to_second = {canonical: own for own, canonical in second.param_paths().items()}
    mapping = {
        own: to_second.get(canonical, canonical)
        for own, canonical in first.param_paths().items()
        if own in first.runner.specs
    }
    try:
        check_bijection(mapping, second.runner.specs)
    except PathMapError as err:
        fail(str(err))
    return mapping


def shared_params(first: Side, second: Side, start: Flat | None = None) -> tuple[Flat, Flat]:
    """``first``'s parameters and the same values on ``second``, both on the devices.

    ``first``'s are its init from seed 0, or ``start`` (its own paths) when given; the
    path map between the two is checked to be a bijection first.
    """
    param_map(first, second)
    params = first.init(0) if start is None else first.place(start)
    return params, second.receive(params, first)


def misplaced(arrays: Mapping[str, Any], shardings: Mapping[str, Any]) -> list[str]:
    """Arrays not placed as ``shardings`` asks, one line each: path, expected, actual."""
    return [
        f"{path}: expected {shardings[path].spec}, placed as {value.sharding}"
        for path, value in sorted(arrays.items())
        if not value.sharding.is_equivalent_to(shardings[path], value.ndim)
    ]


def agreed_specs(
    first: tuple[Side, Mapping[str, Logical], Mapping[str, LeafSpec]],
    second: tuple[Side, Mapping[str, Logical], Mapping[str, LeafSpec]],
    mapping: Mapping[str, str],
    rules: LogicalRules | None = None,
) -> tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]]:
    """Both sides' leaves resolved on the case's mesh: equal per leaf and evenly split.

    Each side is given as ``(side, logical names, shapes)`` of the leaves compared
    (parameters, caches, frozen kernels), ``mapping`` takes the first's paths to the
    second's, and ``rules`` default to the config's :meth:`Family.axis_rules`. Fails
    listing every leaf that differs or splits unevenly; returns each side's specs.
    """
    (a, a_logical, _), (b, b_logical, b_shapes) = first, second
    mesh = b.case.mesh
    a_specs, b_specs = a.case.specs(a_logical, rules), b.case.specs(b_logical, rules)
    problems = []
    for src, dst in sorted(mapping.items(), key=lambda kv: kv[1]):
        if a_specs[src] != b_specs[dst]:
            problems.append(
                f"{dst}: {a.name} {a_specs[src]} (logical {a_logical[src]}) != "
                f"{b.name} {b_specs[dst]} (logical {b_logical[dst]})"
            )
        for dim, size, shards in indivisible(b_shapes[dst].shape, b_specs[dst], mesh):
            problems.append(
                f"{dst}: dim {dim} of size {size} is split {shards} ways by "
                f"{b_specs[dst]} on mesh {mesh.id}: not divisible"
            )
    fail_if_any(f"{len(problems)} problem(s) on mesh {mesh.id}", problems)
    return a_specs, b_specs


def leaf_table(
    specs: Mapping[str, LeafSpec], resolved: Mapping[str, PartitionSpec]
) -> dict[str, dict[str, Any]]:
    """``{path: {"shape", "dtype", "spec"}}`` for every leaf, sorted by path (a golden's body)."""
    return {
        path: {
            "shape": list(spec.shape),
            "dtype": spec.dtype,
            "spec": spec_to_json(resolved[path], len(spec.shape)),
        }
        for path, spec in sorted(specs.items())
    }


def attributed(
    case: Case,
    names: tuple[str, str],
    on_mesh: Pair,
    on_one_device: Callable[[], Pair],
    *,
    quantized: bool = False,
) -> str:
    """Which of two results computed on ``case``'s mesh moves on one device, in words.

    ``on_one_device`` recomputes both on one device (only called here, after a
    failure); never raises (:func:`~conformance.runtime.diagnose.attribution.attribution_text`).
    """
    return attribution_text(case.mesh, names, on_mesh, on_one_device, quantized=quantized)


def forward_attribution(
    first: Side,
    second: Side,
    logits: tuple[Any, Any],
    params: tuple[Flat, Flat],
    *,
    quantized: bool = False,
) -> str:
    """Which side's ``logits`` on the case's mesh move when the forward runs on one device.

    ``logits`` come from ``params`` (each side's own paths); both forwards are rerun
    from the same parameters on the sides' one-device references, so call it only on a
    failure. ``quantized`` (implied by a quantized case): the forward rounds to a grid.
    """

    def on_one_device() -> Pair:
        results = []
        for side, side_params in zip((first, second), params, strict=True):
            reference = side.reference()
            batch = reference.case.batch()
            results.append({"logits": reference.forward(reference.place(side_params), batch)[0]})
        return results[0], results[1]

    on_mesh = ({"logits": logits[0]}, {"logits": logits[1]})
    quantized = quantized or first.case.quant is not None
    return attributed(
        first.case, (first.name, second.name), on_mesh, on_one_device, quantized=quantized
    )


Rerun = Callable[[Flat], Any]
"""A side's quantized computation from float parameters given on the host (own paths)."""


def nudged_reruns(
    reruns: tuple[Rerun | None, Rerun | None], float_params: tuple[Flat | None, Flat | None]
) -> tuple[list[Any], list[Any]]:
    """Each side's quantized results from its float parameters nudged by one ulp.

    One result per seed of :data:`~conformance.core.rounding.NUDGE_SEEDS`: the same
    programs as the compared run, so nothing new is compiled. A side without a rerun (a
    recording) has none.
    """
    first, second = (
        []
        if rerun is None or params is None
        else [rerun(one_ulp_nudge(params, seed)) for seed in NUDGE_SEEDS]
        for rerun, params in zip(reruns, float_params, strict=True)
    )
    return first, second


def quantized_forwards(
    title: str,
    names: tuple[str, str],
    logits: tuple[Any, Any],
    float_logits: tuple[Any, Any],
    reruns: tuple[Rerun | None, Rerun | None],
    float_params: tuple[Flat | None, Flat | None],
) -> str | None:
    """The report of two quantized forwards disagreeing under the quantization-aware policy.

    ``logits`` must agree under the float policy, or differ by float rounding carried
    across quantization steps (:func:`~conformance.core.rounding.rounding_verdict`,
    judged from the ``float_logits`` of the same parameters and each side's ``reruns``
    from nudged ``float_params``; a side that cannot be rerun, a recording, gives
    ``None`` for both). A report says what the float forwards show.
    """
    found = compare_arrays("logits", *logits)
    verdict = None
    if found is not None:

        def moved() -> tuple[list[Flat], list[Flat]]:
            first, second = nudged_reruns(reruns, float_params)
            return [{"logits": x} for x in first], [{"logits": x} for x in second]

        verdict = rounding_verdict(
            "forwards",
            ({"logits": logits[0]}, {"logits": logits[1]}),
            ({"logits": float_logits[0]}, {"logits": float_logits[1]}),
            moved,
            names,
            ("logits",),
        )
    accepted = verdict is not None and verdict.accepted
    emit_verdict(title, "logits", *logits, None if accepted else found, names=names)
    if found is None or accepted:
        return None
    return f"{report(title, [found], names)}\n  {verdict.text}"


def error_bound(where: str, quantized: Any, reference: Any, bound: float) -> None:
    """Quantized logits differ from float ``reference`` logits, by at most ``bound``.

    The measure is the relative L2 error ``||quantized - reference|| / ||reference||``;
    an error of exactly zero fails, as it means quantization did nothing.
    """
    q, r = (host_array(x).astype(np.float64) for x in (quantized, reference))
    error = float(np.linalg.norm(q - r) / max(np.linalg.norm(r), np.finfo(np.float64).tiny))
    if error == 0.0:
        fail(f"{where}: quantized logits equal the float logits exactly; quantization did nothing")
    if not error <= bound:
        fail(
            f"{where}: relative L2 error of quantized vs float logits is {error:.4g}, "
            f"above the bound {bound}"
        )


def round_trip(
    side: Side, tree: Flat, layout: Mapping[str, LeafSpec], directory: Path, what: str
) -> Flat:
    """``tree`` saved with orbax to ``directory`` and restored strictly into ``layout``.

    The checkpoint records the side's case (family, size, backend, layer layout); every
    leaf is restored with the sharding it was saved with. A refused restore fails
    naming ``what``, and so does a leaf that does not come back exactly.
    """
    case = side.case
    info = CheckpointInfo(case.family.name, case.size, side.backend, case.scan_layers)
    save(directory, tree, info)
    try:
        restored = restore(directory, layout, {p: v.sharding for p, v in tree.items()})
    except CheckpointError as err:
        fail(f"{what}: {err}")
    mismatches = compare_trees(tree, restored, EXACT)
    if mismatches:
        fail(failed(f"{what} after an orbax round trip", mismatches, ("saved", "restored")))
    return restored


def train_pair(
    case: Case,
    start: Flat | None = None,
    *,
    micro_batches: int = 1,
    vocab_tiles: int = 1,
) -> tuple[Training, Training]:
    """Both live sides' train states on ``case``, the NNX one holding Linen's parameters.

    Linen's parameters are ``start`` (Linen paths) or its init from seed 0. With
    ``micro_batches`` or ``vocab_tiles`` above 1 both accumulate or tile their loss,
    which must not change the parameters. Parameters that do not fit a side fail the
    check, naming every leaf.
    """
    first, second = live_pair(case)
    param_map(first, second)
    try:
        a = Training.start(first, start, micro_batches, vocab_tiles)
        b = Training.start(
            second, second.own(first.canonical(a.initial)), micro_batches, vocab_tiles
        )
    except TransplantError as err:
        variant = {
            k: v
            for k, v in (("micro_batches", micro_batches), ("vocab_tiles", vocab_tiles))
            if v != 1
        }
        fail(f"the parameters change with {variant}: {err}" if variant else str(err))
    return a, b


def train_steps(case: Case, start: Flat | None = None) -> tuple[Flat, list[tuple[StepResult, ...]]]:
    """:data:`STEPS` steps of both sides from the same parameters: ``(start, results)``."""
    a, b = train_pair(case, start)
    batch = case.batch()
    return a.initial, [(a.advance(batch), b.advance(batch)) for _ in range(STEPS)]


def rerun_note() -> str:
    """The last line of a report that two runs differ bit for bit: why, where they can.

    Empty where the backend is deterministic (see
    :func:`~conformance.core.environment.nondeterminism`).
    """
    note = nondeterminism()
    return f"\n  {note}" if note else ""


def step_tree(result: StepResult) -> Flat:
    """A step's results as one flat tree: ``loss``, ``grads/<path>`` and ``state/<path>``."""
    state, loss, grads = result
    return {
        "loss": loss,
        **{f"grads/{path}": value for path, value in grads.items()},
        **{f"state/{path}": value for path, value in state.items()},
    }


def leaf_group(path: str) -> str:
    """The group a step leaf is plotted in: its module, at most four components deep.

    ``grads/decoder/layers_0/mlp/wi/kernel`` is in ``grads/decoder/layers_0/mlp``;
    ``loss`` is a group of its own.
    """
    return "/".join(path.split("/")[:-1][:4]) or path


def _by_group(first: Flat, second: Flat) -> dict[str, tuple[Flat, Flat]]:
    groups: dict[str, tuple[Flat, Flat]] = {}
    for path in sorted(set(first) & set(second)):
        a, b = groups.setdefault(leaf_group(path), ({}, {}))
        a[path], b[path] = first[path], second[path]
    return groups


def step_disagreement(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    case: Case | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
    figure: str = "",
    series: str = "",
    spread: Callable[[], StepResult] | None = None,
) -> str | None:
    """The report of two steps' ``(state, loss, grads)`` disagreeing, or ``None``.

    Emits the error of each leaf group (:func:`leaf_group`) as a measurement of
    ``figure`` (default ``what``), line ``series`` (default ``what``). With ``case`` and
    ``reference`` (the same two steps on one device, computed only on failure), the
    report says which side computes differently when partitioned. With ``spread`` (the
    second step computed again in another order, only on failure), the steps are
    compared again leaf by leaf: an updated parameter whose gradient is rounding noise
    on both sides (:func:`~conformance.runtime.diagnose.attribution.noise_masked`) and
    an element within the second side's own spread
    (:func:`~conformance.core.numerics.compare_arrays`) pass.
    """
    pair = (step_tree(first), step_tree(second))
    mismatches = compare_trees(*pair)
    if mismatches and spread is not None:
        pair = (pair[0], noise_masked(*pair)[0])
        mismatches = compare_trees(*pair, spread=step_tree(spread()))
    if listening():
        for group, (a, b) in _by_group(*pair).items():
            found = [m for m in mismatches if leaf_group(m.path) == group]
            plot = {"figure": figure or what, "series": series or what, "x": group}
            emit(measure(f"{what}: {group}", a, b, found, names=names, **plot))
    if not mismatches:
        return None
    message = report(what, mismatches, names)
    if case is not None and reference is not None:
        message += "\n  " + attributed(
            case, names, pair, lambda: tuple(step_tree(r) for r in reference())
        )
    return message


def steps_agree(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    case: Case | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
) -> None:
    """Fail with :func:`step_disagreement`'s report unless the two steps agree."""
    message = step_disagreement(what, first, second, names, case=case, reference=reference)
    if message is not None:
        fail(message)


def train_step_parity(case: Case, title: str, float_case: Case | None = None) -> None:
    """Linen and NNX agree for :data:`STEPS` jitted, sharded steps from the same params.

    Compares per step the loss, every gradient, and the whole next state (parameters,
    Adam moments, optax counts and the step counter, which must equal the step number).
    ``title`` names the mode in reports and plots. A failure also says whether each
    side agrees with its own steps on one device. With ``float_case`` (the same case
    unquantized) the comparison is quantization-aware: a step that fails the float policy
    is judged by the float steps from the same parameters (:func:`rounding_step`).
    """
    start, steps = train_steps(case)

    @functools.cache
    def reference() -> list[tuple[StepResult, ...]]:
        return train_steps(case.on_one_device(), start)[1]

    judge = None if float_case is None else rounding_step(case, float_case, start)
    mode = "" if case.quant is None else f" ({case.quant})"
    failures: list[str] = []

    def attribution(step: int) -> Callable[[], tuple[StepResult, ...]] | None:
        return None if failures else functools.partial(lambda i: reference()[i], step - 1)

    for step, (first, second) in enumerate(steps, start=1):
        what = f"step {step} of {STEPS}{mode} on mesh {case.mesh.id}"
        verdict = None
        if judge is not None and compare_trees(step_tree(first), step_tree(second)):
            verdict = judge(step - 1, (first, second))
        message = None
        if verdict is None or not verdict.accepted:
            # Every step is measured, so a report shows how the error grows; the first
            # failing step's report (with its one-device attribution) is the verdict.
            message = step_disagreement(
                what,
                first,
                second,
                case=case,
                reference=attribution(step),
                figure=f"{title}{mode}: error per leaf group and step, mesh {case.mesh.id}",
                series=f"step {step}",
            )
        counter = int(second[0]["optimizer/step"])
        if message is None and counter != step:
            message = f"optimizer/step is {counter} after step {step}"
        if message is not None:
            failures.append(message if verdict is None else f"{message}\n  {verdict.text}")
    if failures:
        fail(failures[0])


def rounding_step(
    case: Case, float_case: Case, start: Flat
) -> Callable[[int, tuple[StepResult, StepResult]], RoundingVerdict]:
    """A judge of quantized train steps from ``start`` that fail the float policy.

    ``judge(i, steps)`` is :func:`~conformance.core.rounding.rounding_verdict` of step
    ``i``'s two results, from the float steps of ``float_case`` and the quantized steps
    from ``start`` nudged by one ulp (both computed once, on the first call). Only the
    nudge bound applies: the sides' gradient errors against float spread too much on
    correct pairs (up to 4.8 % per leaf) to tell a side that quantizes differently (4 %
    to 17 %); the quantized forward checks tell it.
    """

    @functools.cache
    def floats() -> list[tuple[StepResult, ...]]:
        return train_steps(float_case, start)[1]

    @functools.cache
    def nudged() -> list[list[tuple[StepResult, ...]]]:
        return [train_steps(case, one_ulp_nudge(start, seed))[1] for seed in NUDGE_SEEDS]

    def judge(index: int, steps: tuple[StepResult, StepResult]) -> RoundingVerdict:
        def moved() -> tuple[list[Flat], list[Flat]]:
            runs = [run[index] for run in nudged()]
            return [step_tree(r[0]) for r in runs], [step_tree(r[1]) for r in runs]

        quantized = (step_tree(steps[0]), step_tree(steps[1]))
        twin = floats()[index]
        return rounding_verdict(
            "train steps",
            quantized,
            (step_tree(twin[0]), step_tree(twin[1])),
            moved,
            ("Linen", "NNX"),
            (),
        )

    return judge
