"""Train-step checks: parity across backends, accumulation, layout variants, hygiene.

Like :mod:`conformance.checks`, each function raises :class:`CheckFailure` with a report
that names the family, the check, the step and the leaf path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from conformance.checks import (
    BATCH_SIZE,
    fail,
    fail_if_any,
    misplaced,
    param_map,
    place_batch,
    resolve_all,
    shardings_for,
)
from conformance.contract import Batch, Family
from conformance.core.numerics import compare_trees, report
from conformance.core.records import emit, listening, measure
from conformance.core.sharding import MeshSpec, indivisible, spec_to_json
from conformance.core.trees import (
    Flat,
    flatten,
    flatten_state,
    layer_table,
    map_paths,
    map_state_paths,
    restack,
    specs,
    structure_diff,
    variable_kind,
)
from conformance.runtime.backends import TransplantError, transplant
from conformance.runtime.diagnose.attribution import attribution_text, one_device
from conformance.runtime.training import (
    LinenTrainer,
    NnxTrainer,
    flat_state,
    linen_trainer,
    masked_token_loss,
    nnx_trainer,
)

STEPS = 3
"""Train steps compared for parity."""

MICRO_BATCHES = 4
"""Micro-batches the accumulation check splits a batch into."""

PERSISTENT = (nnx.Param, nnx.OptState)
"""Variable types allowed in an NNX train state (optimizer variables subclass OptState)."""


@dataclasses.dataclass
class Side:
    """One backend's trainer, placed state and step function on a mesh."""

    trainer: LinenTrainer | NnxTrainer
    state: Any
    shardings: Any
    step: Any


def _side(
    family: Family,
    check: str,
    trainer: LinenTrainer | NnxTrainer,
    params: Flat,
    mesh: MeshSpec,
    devices: Mesh,
) -> Side:
    by_path = shardings_for(family, check, trainer.logical, mesh, devices)
    shardings = trainer.tree(by_path)
    state = jax.device_put(trainer.initial_state(params), shardings)
    return Side(trainer, state, shardings, trainer.step_fn(shardings))


def linen_and_nnx(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    micro_batches: int = 1,
    quant: str | None = None,
    *,
    check: str,
    start: Flat | None = None,
    vocab_tiles: int = 1,
) -> tuple[Side, Side, dict[str, str]]:
    """Both sides' placed initial train states, NNX holding Linen's parameters.

    The Linen parameters are ``start`` (Linen paths, placed on ``devices`` here) or,
    by default, initialised from seed 0. With ``quant`` (a QAT mode), both models are
    quantized; with ``vocab_tiles > 1``, both compute their loss in that many tiles.
    ``config`` is bound to ``devices`` (:meth:`Family.with_mesh`). A failure while
    setting up is reported under ``check``. Returns ``(linen, nnx, {Linen state path:
    NNX state path})``.
    """
    config = family.with_mesh(config, devices)
    lt, nt = (
        linen_trainer(family, config, micro_batches, quant, vocab_tiles),
        nnx_trainer(family, config, micro_batches, quant, vocab_tiles),
    )
    mapping = param_map(family, check, config)
    if lt.overwrite:
        mapping |= map_paths(family.path_rules(config), lt.overwrite)
    linen_sh = shardings_for(family, check, lt.runner.logical, mesh, devices)
    if start is None:
        linen_params = lt.runner.init(0, linen_sh)
    else:
        linen_params = transplant(start, {}, lt.runner.specs, linen_sh)
    nnx_shardings = shardings_for(family, check, nt.runner.logical, mesh, devices)
    nnx_params = transplant(linen_params, mapping, nt.runner.specs, nnx_shardings)
    linen = _side(family, check, lt, linen_params, mesh, devices)
    nnx_side = _side(family, check, nt, nnx_params, mesh, devices)
    return linen, nnx_side, map_state_paths(mapping, flatten(linen.state))


def _renamed(flat: Flat, mapping: dict[str, str]) -> Flat:
    return {mapping.get(path, path): value for path, value in flat.items()}


StepResult = tuple[Flat, Any, Flat]
"""One step's ``(state, loss, grads)``, keyed by NNX paths."""


def step_tree(result: StepResult) -> Flat:
    """A step's results as one flat tree: ``loss``, ``grads/<path>`` and ``state/<path>``."""
    state, loss, grads = result
    return {
        "loss": loss,
        **{f"grads/{path}": value for path, value in grads.items()},
        **{f"state/{path}": value for path, value in state.items()},
    }


def compare_steps(
    family: Family,
    check: str,
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    mesh: MeshSpec | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
) -> None:
    """Fail unless two steps' ``(state, loss, grads)`` agree leaf for leaf.

    With ``mesh`` and ``reference`` (the same two steps on one device, computed only on
    failure), the report says which side computes differently when partitioned.
    """
    message = step_disagreement(what, first, second, names, mesh=mesh, reference=reference)
    if message is not None:
        fail(family, check, message)


def step_disagreement(
    what: str,
    first: StepResult,
    second: StepResult,
    names: tuple[str, str] = ("Linen", "NNX"),
    *,
    mesh: MeshSpec | None = None,
    reference: Callable[[], tuple[StepResult, StepResult]] | None = None,
    figure: str = "",
    series: str = "",
) -> str | None:
    """:func:`compare_steps`' failure report, or ``None`` when the steps agree.

    Emits the error of each leaf group (:func:`leaf_group`) as a measurement of
    ``figure`` (default ``what``), line ``series`` (default ``what``).
    """
    pair = (step_tree(first), step_tree(second))
    mismatches = compare_trees(*pair)
    if listening():
        for group, (a, b) in _by_group(*pair).items():
            found = [m for m in mismatches if leaf_group(m.path) == group]
            emit(
                measure(
                    f"{what}: {group}",
                    a,
                    b,
                    found,
                    names=names,
                    figure=figure or what,
                    series=series or what,
                    x=group,
                )
            )
    if not mismatches:
        return None
    message = report(what, mismatches, names)
    if mesh is not None and reference is not None:
        message += "\n  " + attribution_text(
            mesh, names, pair, lambda: tuple(step_tree(r) for r in reference())
        )
    return message


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


def _train_steps(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    quant: str | None,
    check: str,
    start: Flat | None = None,
) -> tuple[Flat, list[tuple[StepResult, StepResult]]]:
    """:data:`STEPS` steps of both sides from the same parameters: ``(start, results)``."""
    linen, nnx_side, mapping = linen_and_nnx(
        family, config, mesh, devices, quant=quant, check=check, start=start
    )
    start = params_of(flat_state(linen.state))
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    return start, [advance(linen, nnx_side, mapping, batch) for _ in range(STEPS)]


def check_train_step(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    quant: str | None = None,
    check: str | None = None,
) -> None:
    """Linen and NNX agree for :data:`STEPS` jitted, sharded steps from the same params.

    Compares per step the loss, every gradient, and the whole next state (parameters,
    Adam moments, optax counts and the step counter, which must equal the step number).
    With ``quant`` (a QAT mode), both sides train quantized models. Reports are headed
    ``check``: by default ``train_step``, or ``qat_train_step`` with ``quant``. A
    failure also says whether each side agrees with its own steps on one device.
    """
    check = check or ("train_step" if quant is None else "qat_train_step")
    start, steps = _train_steps(family, config, mesh, devices, quant, check)

    @functools.cache
    def reference() -> list[tuple[StepResult, StepResult]]:
        one = one_device(mesh)
        return _train_steps(family, config, one, one.devices(), quant, check, start)[1]

    mode = "" if quant is None else f" ({quant})"
    failures = []
    for step, (first, second) in enumerate(steps, start=1):
        # Every step is measured, so a report shows how the error grows; the first
        # failing step's report (with its one-device attribution) is the verdict.
        message = step_disagreement(
            f"step {step} of {STEPS}{mode} on mesh {mesh.id}",
            first,
            second,
            mesh=mesh,
            reference=None if failures else functools.partial(lambda i: reference()[i], step - 1),
            figure=f"{check}{mode}: error per leaf group and step, mesh {mesh.id}",
            series=f"step {step}",
        )
        counter = int(second[0]["optimizer/step"])
        if message is None and counter != step:
            message = f"optimizer/step is {counter} after step {step}"
        if message is not None:
            failures.append(message)
    if failures:
        fail(family, check, failures[0])


def check_fp8_train_step(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """:func:`check_train_step` on the family's FP8 config (:meth:`Family.fp8_config`).

    Each step's comparison covers the parameters' gradients and the whole next state,
    which holds the FP8 scales and amax histories each side overwrote with its gradient.
    """
    check_train_step(family, family.fp8_config(config), mesh, devices, check="fp8_train_step")


def _plain_and_variant(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    check: str,
    variant: Mapping[str, Any],
    start: Flat | None = None,
) -> tuple[Flat, tuple[StepResult, StepResult], tuple[StepResult, StepResult]]:
    """One step of both sides, plain and with ``variant``: ``(start, plain, varied)``.

    ``variant`` holds keywords of :func:`linen_and_nnx`; both steps start from the same
    parameters.
    """
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    linen, nnx_side, mapping = linen_and_nnx(
        family, config, mesh, devices, check=check, start=start
    )
    start = params_of(flat_state(linen.state))
    plain = advance(linen, nnx_side, mapping, batch)
    try:
        varied = linen_and_nnx(family, config, mesh, devices, check=check, start=start, **variant)
    except TransplantError as err:
        fail(family, check, f"the parameters change with {dict(variant)}: {err}")
    return start, plain, advance(*varied, batch)


def check_step_variant(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    check: str,
    names: tuple[str, str],
    variant: Mapping[str, Any],
) -> None:
    """One step with ``variant`` (keywords of :func:`linen_and_nnx`) equals the plain step.

    Holds on each backend, and across backends for the varied step; ``names`` name the
    plain and the varied step in reports. A failure also says whether each result
    agrees with the same step on one device.
    """
    start, plain, varied = _plain_and_variant(family, config, mesh, devices, check, variant)

    @functools.cache
    def reference() -> tuple[Any, ...]:
        one = one_device(mesh)
        return _plain_and_variant(family, config, one, one.devices(), check, variant, start)[1:]

    what = f"one step on mesh {mesh.id}"
    for i, side in enumerate(("Linen", "NNX")):
        compare_steps(
            family,
            check,
            f"{side} {what}",
            plain[i],
            varied[i],
            names,
            mesh=mesh,
            reference=functools.partial(lambda i: tuple(r[i] for r in reference()), i),
        )
    compare_steps(
        family,
        check,
        f"{names[1]}, {what}",
        varied[0],
        varied[1],
        mesh=mesh,
        reference=lambda: reference()[1],
    )


def check_grad_accumulation(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """:data:`MICRO_BATCHES` accumulated micro-batches equal one step on the whole batch.

    Holds on each backend, and across backends for the accumulated step
    (:func:`check_step_variant`).
    """
    names = ("whole batch", f"{MICRO_BATCHES} micro-batches")
    variant = {"micro_batches": MICRO_BATCHES}
    check_step_variant(family, config, mesh, devices, "grad_accumulation", names, variant)


def advance(
    linen: Side, nnx_side: Side, mapping: dict[str, str], batch: Batch
) -> tuple[StepResult, StepResult]:
    """Step both sides once (their states advance); ``(state, loss, grads)`` by NNX paths."""
    param_mapping = {
        k.removeprefix("model/"): v.removeprefix("model/")
        for k, v in mapping.items()
        if k.startswith("model/")
    }
    linen.state, a = linen.step(linen.state, batch)
    nnx_side.state, b = nnx_side.step(nnx_side.state, batch)
    return (
        (
            _renamed(flat_state(linen.state), mapping),
            a["loss"],
            _renamed(flatten(a["grads"]), param_mapping),
        ),
        (flat_state(nnx_side.state), b["loss"], flat_state(b["grads"])),
    )


def params_of(state: Flat) -> Flat:
    """The model parameters of a flat train state, keyed by their parameter paths."""
    return {p.removeprefix("model/"): v for p, v in state.items() if p.startswith("model/")}


def _to_variant(family: Family, config: Any, changed: Any, side: str, variant: str) -> Any:
    """Convert one backend's plain-layout parameter paths/values to the variant's layout."""
    if variant != "scan_layers":
        return dict
    rules = family.layer_stack_rules(config)
    if not rules:
        fail(family, "layout", "declares both layer layouts but no layer_stack_rules to stack them")
    table = layer_table(rules, linen_trainer(family, config).runner.specs)
    if side == "Linen":
        return lambda flat: restack(flat, table, True, family.layer_stack_axis)
    to_linen = {v: k for k, v in param_map(family, "layout", config).items()}
    to_nnx = param_map(family, "layout", changed)
    return lambda flat: _renamed(
        restack(_renamed(flat, to_linen), table, True, family.layer_stack_axis), to_nnx
    )


LAYOUT_VARIANTS = ("remat", "scan_layers")
"""Variants :func:`check_layout_invariance` compares with the plain layout."""


def _layout_steps(
    family: Family,
    configs: tuple[Any, Any],
    mesh: MeshSpec,
    devices: Mesh,
    variant: str,
    side: str,
    start: Flat | None = None,
) -> tuple[Flat, tuple[StepResult, StepResult]]:
    """One step of ``side`` in the plain and the varied config from the same parameters.

    Returns ``(start, (plain, varied))``, the plain step converted to the varied layout;
    ``start`` is the plain config's parameters (initialised from seed 0 by default).
    """
    config, changed = (family.with_mesh(c, devices) for c in configs)
    trainer_of = linen_trainer if side == "Linen" else nnx_trainer
    convert = _to_variant(family, config, changed, side, variant)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    results = []
    for cfg in (config, changed):
        trainer = trainer_of(family, cfg)
        param_sh = shardings_for(family, "layout", trainer.runner.logical, mesh, devices)
        if start is None:
            start = trainer.runner.init(0, param_sh)
        params = start if cfg is config else convert(start)
        params = transplant(params, {}, trainer.runner.specs, param_sh)
        placed = _side(family, "layout", trainer, params, mesh, devices)
        state, metrics = placed.step(placed.state, batch)
        results.append(
            (params_of(flat_state(state)), metrics["loss"], flat_state(metrics["grads"]))
        )
    (state_a, loss_a, grads_a), varied = results
    return start, ((convert(state_a), loss_a, convert(grads_a)), varied)


def check_layout_invariance(
    family: Family, size: str, mesh: MeshSpec, devices: Mesh, variant: str
) -> None:
    """A variant that must not change numerics does not: ``remat`` or ``scan_layers``.

    The plain config is ``size`` with a list of layers; the varied one is
    :meth:`~conformance.contract.Family.variant` with ``remat``, or the scanned config.
    On each backend, one step of each from the same parameters gives the same loss,
    gradients and next parameters; for ``scan_layers`` the plain layout's layers are
    stacked with the family's :meth:`~conformance.contract.Family.layer_stack_rules`.
    A failure also says whether each layout agrees with itself on one device.
    """
    if variant not in LAYOUT_VARIANTS:
        raise ValueError(f"unknown layout variant {variant!r}; use one of {LAYOUT_VARIANTS}")
    config = family.config(size, scan_layers=False)
    if variant == "remat":
        changed = family.variant(config, remat=True)
    else:
        changed = family.config(size, scan_layers=True)
    for side in ("Linen", "NNX"):
        start, (plain, varied) = _layout_steps(
            family, (config, changed), mesh, devices, variant, side
        )

        def reference(side: str = side, start: Flat = start) -> tuple[StepResult, StepResult]:
            one = one_device(mesh)
            steps = _layout_steps(
                family, (config, changed), one, one.devices(), variant, side, start
            )
            return steps[1]

        compare_steps(
            family,
            "layout",
            f"{side} one step on mesh {mesh.id}",
            plain,
            varied,
            ("plain", variant),
            mesh=mesh,
            reference=reference,
        )


def _nnx_transients(state: nnx.State) -> list[str]:
    """Leaves of an NNX state that are not parameters or optimizer state, with their type."""
    return [
        f"{path}: {variable_kind(var)} is not persistent state"
        for path, var in flatten_state(state).items()
        if not isinstance(var, PERSISTENT)
    ]


def check_hygiene(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """A step returns exactly the state it was given: nothing transient, nothing lost.

    On each backend: the returned state has the input's paths, shapes, dtypes, leaf
    count and shardings; (NNX) it holds only parameters and optimizer state, no
    ``nnx.Intermediate`` or Variable type made by sowing under a string name; the state
    and its sharding tree have equal leaf counts; and the step leaks no tracer
    (``jax.checking_leaks``).
    """
    linen, nnx_side, _ = linen_and_nnx(family, config, mesh, devices, check="hygiene")
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    for side, placed in (("Linen", linen), ("NNX", nnx_side)):
        trainer = placed.trainer
        out, _ = jax.eval_shape(trainer._step, trainer.abstract_state, batch)
        problems = structure_diff(
            specs(flat_state(trainer.abstract_state)), specs(flat_state(out)), {}
        )
        if isinstance(out, nnx.State):
            problems += _nnx_transients(out)
        n_state, n_shard = (
            len(jax.tree.leaves(placed.state)),
            len(jax.tree.leaves(placed.shardings)),
        )
        if n_state != n_shard:
            problems.append(f"state has {n_state} leaves but its sharding tree has {n_shard}")
        title = f"{side} train step does not return its input state (left: input, right: output)"
        fail_if_any(family, "hygiene", title, problems)
        try:
            with jax.checking_leaks():
                new_state, _ = placed.step(placed.state, batch)
        except Exception as err:  # jax reports a leaked tracer as a plain Exception
            if "leak" not in str(err).lower():
                raise
            fail(family, "hygiene", f"{side} train step leaks a tracer: {err}")
        expected = {p: v.sharding for p, v in flat_state(placed.state).items()}
        fail_if_any(
            family,
            "hygiene",
            f"{side} train step changes shardings",
            misplaced(flat_state(new_state), expected),
        )


def check_optimizer_sharding(family: Family, config: Any, mesh: MeshSpec) -> dict[str, Any]:
    """Both sides shard every optimizer-state leaf alike, and evenly; returns the golden.

    Linen's optimizer leaves take the spec of the parameter they mirror; NNX's are read
    from the optimizer Variables' own ``out_sharding`` metadata, resolved by the same
    rules, so a divergence in how NNX annotates optimizer state is caught.
    """
    lt, nt = linen_trainer(family, config), nnx_trainer(family, config)
    mapping = map_state_paths(param_map(family, "optimizer_sharding", config), lt.logical)
    rules = family.axis_rules(config)
    linen_specs = resolve_all(family, "optimizer_sharding", lt.logical, mesh, rules)
    nnx_specs = resolve_all(family, "optimizer_sharding", nt.logical, mesh, rules)
    shapes = specs(flat_state(nt.abstract_state))
    problems = []
    for src, dst in sorted(mapping.items(), key=lambda kv: kv[1]):
        if not dst.startswith("optimizer/"):
            continue
        if dst not in nnx_specs:
            problems.append(f"{dst}: Linen has it (as {src}); NNX does not")
            continue
        if linen_specs[src] != nnx_specs[dst]:
            problems.append(
                f"{dst}: Linen {linen_specs[src]} != NNX {nnx_specs[dst]} "
                f"(NNX logical {nt.logical[dst]})"
            )
        for dim, size, shards in indivisible(shapes[dst].shape, nnx_specs[dst], mesh):
            problems.append(
                f"{dst}: dim {dim} of size {size} is split {shards} ways: not divisible"
            )
    title = f"{len(problems)} problem(s) on mesh {mesh.id}"
    fail_if_any(family, "optimizer_sharding", title, problems)
    return {
        "mesh": dict(mesh.axes),
        "leaves": {
            p: spec_to_json(s, len(shapes[p].shape))
            for p, s in sorted(nnx_specs.items())
            if p.startswith("optimizer/")
        },
    }


DROPOUT_RATE = 0.1
"""Dropout rate :func:`check_dropout` asks the family's :meth:`~Family.variant` for."""


def check_dropout(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """With dropout on, each backend trains deterministically for a fixed seed.

    The config is :meth:`~conformance.contract.Family.variant` with dropout at
    :data:`DROPOUT_RATE`. Two runs of two steps from the same parameters give identical
    losses, and dropout is really applied: the first training loss differs from the
    deterministic forward's.
    """
    noisy = family.variant(family.with_mesh(config, devices), dropout=DROPOUT_RATE)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    for side, trainer in (
        ("Linen", linen_trainer(family, noisy)),
        ("NNX", nnx_trainer(family, noisy)),
    ):
        param_sh = shardings_for(family, "dropout", trainer.runner.logical, mesh, devices)
        params = trainer.runner.init(0, param_sh)
        loss_sum, count = masked_token_loss(trainer.runner.forward(params, batch)[0], batch)
        runs = [_dropout_losses(family, trainer, params, batch, mesh, devices) for _ in range(2)]
        if runs[0] != runs[1]:
            fail(
                family,
                "dropout",
                f"{side} losses differ between two runs from one seed: {runs[0]} vs {runs[1]}",
            )
        if runs[0][0] == float(loss_sum / count):
            fail(
                family,
                "dropout",
                f"{side} training loss with dropout {DROPOUT_RATE} equals the "
                f"deterministic loss ({runs[0][0]!r}): dropout is not applied",
            )


def _dropout_losses(
    family: Family,
    trainer: LinenTrainer | NnxTrainer,
    params: Flat,
    batch: Batch,
    mesh: MeshSpec,
    devices: Mesh,
) -> list[float]:
    placed = _side(family, "dropout", trainer, params, mesh, devices)
    state, losses = placed.state, []
    for _ in range(2):
        state, metrics = placed.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses
