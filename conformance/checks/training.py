"""Train-step checks: parity across backends, accumulation, layout variants, hygiene.

Each check compares jitted, sharded train steps of the two sides (or of one side in two
configurations) leaf for leaf through :mod:`conformance.checks.kernel`; reports name
the step and the leaf path, and say whether each side agrees with itself on one device.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from conformance.checks.declare import ON_MESH, Axis, Param, declare
from conformance.checks.kernel import (
    DROPOUT_RATE,
    misplaced,
    paired,
    steps_agree,
    train_pair,
    train_step_parity,
    variant_parity,
)
from conformance.contract import (
    AuxLosses,
    Dropout,
    Family,
    Fp8,
    Remat,
    declared,
    persistent_types,
    required,
)
from conformance.core.distributed import host_array
from conformance.core.failure import fail, fail_if_any
from conformance.core.numerics import compare_arrays, compare_trees, tolerance_for
from conformance.core.records import failed
from conformance.core.sharding import indivisible, spec_to_json
from conformance.core.trees import (
    Flat,
    flatten_state,
    restack,
    specs,
    structure_diff,
    variable_kind,
)
from conformance.runtime.case import Case
from conformance.runtime.layouts import stacking
from conformance.runtime.objective import aux_total, mean_token_loss
from conformance.runtime.sides import Side, live_pair
from conformance.runtime.stepping import StepResult, Training, params_of
from conformance.runtime.train_state import flat_state

MICRO_BATCHES = 4
"""Micro-batches the accumulation check splits a batch into."""

VOCAB_TILES = 4
"""Slices the tiled loss cuts the batch's positions into."""

PERSISTENT = (nnx.Param, nnx.OptState)
"""Variable types allowed in an NNX train state (optimizer variables subclass OptState)."""

LAYOUT_VARIANTS = (
    Param("remat", "remat", capability="remat"),
    Param("scan_layers", "scan_layers", layouts=(True,)),
)
"""Variants :func:`check_layout` compares with the plain layout, and what each needs."""


def _additive_loss(family: Family) -> str | None:
    """Why micro-batches cannot reproduce ``family``'s whole-batch step, if they cannot.

    Only a family whose own configs sow auxiliary losses (an :class:`AuxLosses` without
    a config of its own).
    """
    losses = declared(family, AuxLosses)
    if losses is not None and losses.config is None:
        return (
            f"{family.name} sows auxiliary losses ({', '.join(losses.names)}) that may be "
            "computed from batch statistics: accumulated over micro-batches they are "
            "computed per micro-batch, so the step need not equal the whole batch's"
        )
    return None


@declare((*ON_MESH, Axis.PAIR))
def check_train_step(case: Case) -> None:
    """The case's two sides agree for :data:`~conformance.checks.kernel.STEPS` steps.

    Linen and NNX, or the NNX model in two modes (the ``pair`` axis).

    See :func:`~conformance.checks.kernel.train_step_parity`.
    """
    train_step_parity(case, "train_step")


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="primary", variant=True, capability="fp8")
def check_fp8_train_step(case: Case) -> None:
    """:func:`check_train_step` on the family's FP8 config (:meth:`Family.fp8_config`).

    Each step's comparison covers the parameters' gradients and the whole next state,
    which holds the FP8 scales and amax histories each side overwrote with its gradient.
    """
    fp8 = required(case.family, Fp8).config
    train_step_parity(case.with_config(fp8(case.config)), "fp8_train_step")


@declare((*ON_MESH, Axis.DTYPE), variant=True, requires=_additive_loss)
def check_grad_accumulation(case: Case) -> None:
    """:data:`MICRO_BATCHES` accumulated micro-batches equal one step on the whole batch.

    Holds on each backend, and across backends for the accumulated step; in float32 and
    in bfloat16 compute (float32 parameters and optimizer state), where a pair beyond
    the bfloat16 policy passes when it differs by rounding
    (:func:`~conformance.checks.kernel.variant_parity`).
    """
    names = ("whole batch", f"{MICRO_BATCHES} micro-batches")
    variant_parity(case, names, {"micro_batches": MICRO_BATCHES})


@declare(ON_MESH, variant=True, capability="vocab_tiling")
def check_vocab_tiling(case: Case) -> None:
    """One step with a :data:`VOCAB_TILES`-tiled loss equals the untiled step.

    A tiled loss never holds the ``[batch, seq, vocab]`` logits at once, so it usually
    comes with a hand-written backward pass; one that drops the cotangent it is given,
    or mis-slices the hidden states, still trains, only with wrong gradients. Holds on
    each backend (loss, every gradient, the next state), and across backends for the
    tiled step. The tiled step differentiates the mean loss, so the tiled loss's
    backward pass receives a cotangent other than 1. Tiling must not change the
    parameters.
    """
    names = ("untiled", f"{VOCAB_TILES} vocab tiles")
    variant_parity(case, names, {"vocab_tiles": VOCAB_TILES})


def _to_variant(plain: Side, varied: Side, variant: str) -> Any:
    """Convert ``plain``'s parameter paths and values to ``varied``'s layout."""
    if variant != "scan_layers":
        return dict
    tables = stacking(plain.case.family, plain.case.bound, varied.case.bound)
    if not tables.params:
        fail("declares both layer layouts but no stack rules that stack them")
    return lambda flat: varied.own(restack(plain.canonical(flat), tables.params, True, tables.axis))


def _layout_steps(
    sides: tuple[Side, Side], variant: str, start: Flat | None = None
) -> tuple[Flat, tuple[StepResult, StepResult]]:
    """One step of a plain and a varied side from the same parameters.

    Returns ``(start, (plain, varied))``, the plain step converted to the varied
    layout; ``start`` is the plain side's parameters (initialised from seed 0 by
    default).
    """
    plain, varied = sides
    convert = _to_variant(plain, varied, variant)
    batch = plain.case.batch()
    results = []
    for side in sides:
        params = start if side is plain else convert(start)
        training = Training.start(side, params)
        if start is None:
            start = training.initial
        state, metrics = training.step(training.state, batch)
        results.append(
            (
                params_of(flat_state(state), training.trainer.runner.specs),
                metrics["loss"],
                flat_state(metrics["grads"]),
            )
        )
    (state_a, loss_a, grads_a), varied_step = results
    return start, ((convert(state_a), loss_a, convert(grads_a)), varied_step)


@declare((Axis.FAMILY, Axis.MESH), (("variant", LAYOUT_VARIANTS),), layouts=(False,))
def check_layout(case: Case, variant: str) -> None:
    """A variant that must not change numerics does not: ``remat`` or ``scan_layers``.

    The plain config is the case's, with a list of layers; the varied one is
    :meth:`~conformance.contract.Family.variant` with ``remat``, or the scanned config.
    On each backend, one step of each from the same parameters gives the same loss,
    gradients and next parameters; for ``scan_layers`` the plain layout's layers are
    stacked by the family's :attr:`Layouts.stack <conformance.contract.Layouts.stack>`.
    A failure also says whether each layout agrees with itself on one device.
    """
    if variant not in (names := [v.value for v in LAYOUT_VARIANTS]):
        raise ValueError(f"unknown layout variant {variant!r}; use one of {names}")
    family = case.family
    plain_case = Case.of(family, case.size, scan_layers=False, mesh=case.mesh, devices=case.devices)
    if variant == "remat":
        varied_case = plain_case.with_config(required(family, Remat).config(plain_case.config))
    else:
        varied_case = Case.of(
            family, case.size, scan_layers=True, mesh=case.mesh, devices=case.devices
        )
    for plain, varied in zip(live_pair(plain_case), live_pair(varied_case), strict=True):
        start, (plain_step, varied_step) = _layout_steps((plain, varied), variant)

        def reference(
            sides: tuple[Side, Side] = (plain, varied), start: Flat = start
        ) -> tuple[StepResult, StepResult]:
            return _layout_steps(tuple(s.reference() for s in sides), variant, start)[1]

        steps_agree(
            f"{plain.name} one step on mesh {case.mesh.id}",
            plain_step,
            varied_step,
            ("plain", variant),
            case=case,
            reference=reference,
        )


def _nnx_transients(state: nnx.State, declared: tuple[type, ...]) -> list[str]:
    """Leaves of an NNX state that are not persistent state, with their type.

    Persistent: parameters, optimizer state and the ``declared`` types
    (:class:`~conformance.contract.PersistentState`).
    """
    return [
        f"{path}: {variable_kind(var)} is not persistent state"
        for path, var in flatten_state(state).items()
        if not isinstance(var, (*PERSISTENT, *declared))
    ]


@declare(ON_MESH)
def check_hygiene(case: Case) -> None:
    """A step returns exactly the state it was given: nothing transient, nothing lost.

    On each backend: the returned state has the input's paths, shapes, dtypes, leaf
    count and shardings; (NNX) it holds only parameters, optimizer state and the
    family's declared :class:`~conformance.contract.PersistentState` types, no
    ``nnx.Intermediate`` or Variable type made by sowing under a string name; the state
    and its sharding tree have equal leaf counts; and the step leaks no tracer
    (``jax.checking_leaks``).
    """
    pair = train_pair(case)
    batch = case.batch()
    for training in pair:
        name, trainer = training.side.name, training.trainer
        out, _ = jax.eval_shape(trainer.step, trainer.abstract_state, batch)
        problems = structure_diff(
            specs(flat_state(trainer.abstract_state)),
            specs(flat_state(out)),
            {},
            names=("its input", "its output"),
        )
        if isinstance(out, nnx.State):
            problems += _nnx_transients(out, persistent_types(case.family))
        n_state = len(jax.tree.leaves(training.state))
        n_shard = len(jax.tree.leaves(training.shardings))
        if n_state != n_shard:
            problems.append(f"state has {n_state} leaves but its sharding tree has {n_shard}")
        title = f"{name} train step does not return its input state"
        fail_if_any(title, problems)
        try:
            with jax.checking_leaks():
                new_state, _ = training.step(training.state, batch)
        except Exception as err:  # jax reports a leaked tracer as a plain Exception
            if "leak" not in str(err).lower():
                raise
            fail(f"{name} train step leaks a tracer: {err}")
        expected = {p: v.sharding for p, v in flat_state(training.state).items()}
        fail_if_any(
            f"{name} train step changes shardings",
            misplaced(flat_state(new_state), expected),
        )


@declare(ON_MESH, devices=False, golden=True)
def check_optimizer_sharding(case: Case) -> dict[str, Any]:
    """Both sides shard every optimizer-state leaf alike, and evenly; returns the golden.

    Linen's optimizer leaves take the spec of the parameter they mirror; NNX's are read
    from the optimizer Variables' own ``out_sharding`` metadata, resolved by the same
    rules, so a divergence in how NNX annotates optimizer state is caught.
    """
    linen, nnx_ = live_pair(case)
    lt, nt = linen.trainer(), nnx_.trainer()
    paired(linen, nnx_)
    linen_specs, nnx_specs = case.specs(linen.canonical(lt.logical)), case.specs(nt.logical)
    shapes = specs(flat_state(nt.abstract_state))
    problems = []
    for dst in sorted(p for p in linen_specs if p.startswith("optimizer/")):
        if dst not in nnx_specs:
            problems.append(f"{dst}: Linen has it; NNX does not")
            continue
        if linen_specs[dst] != nnx_specs[dst]:
            problems.append(
                f"{dst}: Linen {linen_specs[dst]} != NNX {nnx_specs[dst]} "
                f"(NNX logical {nt.logical[dst]})"
            )
        for dim, size, shards in indivisible(shapes[dst].shape, nnx_specs[dst], case.mesh):
            problems.append(
                f"{dst}: dim {dim} of size {size} is split {shards} ways: not divisible"
            )
    fail_if_any(f"{len(problems)} problem(s) on mesh {case.mesh.id}", problems)
    return {
        "mesh": dict(case.mesh.axes),
        "leaves": {
            p: spec_to_json(s, len(shapes[p].shape))
            for p, s in sorted(nnx_specs.items())
            if p.startswith("optimizer/")
        },
    }


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="primary", capability="dropout")
def check_dropout(case: Case) -> None:
    """With dropout on, each backend trains deterministically for a fixed seed.

    The config is :meth:`~conformance.contract.Family.variant` with dropout at
    :data:`DROPOUT_RATE`. Two runs of two steps from the same parameters give identical
    losses, and dropout is really applied: the first training loss differs from the
    deterministic forward's by more than float32 rounding (the tolerance policy: two
    programs that compute the same loss need not round it alike).
    """
    noisy = case.with_config(required(case.family, Dropout).config(case.config, DROPOUT_RATE))
    batch = case.batch()
    for side in live_pair(noisy):
        params = side.init(0)
        logits = side.forward(params, batch)[0]
        loss = mean_token_loss(logits, batch, noisy.family.logits_predict)
        runs = [_dropout_losses(side, params, batch) for _ in range(2)]
        if runs[0] != runs[1]:
            fail(
                f"{side.name} losses differ between two runs from one seed: {runs[0]} vs {runs[1]}"
            )
        tolerance = tolerance_for(np.float32)
        if compare_arrays("loss", np.float32(runs[0][0]), loss, tolerance) is None:
            fail(
                f"{side.name} training loss with dropout {DROPOUT_RATE} equals the "
                f"deterministic loss within float32 rounding ({tolerance}): "
                f"{runs[0][0]!r} and {float(loss)!r}: dropout is not applied"
            )


def _dropout_losses(side: Side, params: Flat, batch: Any) -> list[float]:
    training = Training.start(side, params)
    state, losses = training.state, []
    for _ in range(2):
        state, metrics = training.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


@declare(ON_MESH, capability="aux_losses")
def check_aux_losses(case: Case) -> None:
    """The auxiliary losses a family sows reach the training loss, alike on both backends.

    One train step of the family's :attr:`AuxLosses.config
    <conformance.contract.AuxLosses.config>` from the same parameters on each side: every
    name the family declares (:class:`~conformance.contract.AuxLosses`) must be added to
    the loss and be non-zero, with a non-zero gradient of their own; the two sides' values
    and gradients must agree under the tolerance policy; and each side's loss must be its
    cross entropy (its own forward's logits, the harness's loss) plus exactly those values:
    nothing strips them before the loss, nothing adds them twice, nothing detaches them.
    """
    losses = required(case.family, AuxLosses)
    names = losses.names
    case = case.with_config(case.config if losses.config is None else losses.config(case.config))
    pair = train_pair(case)
    batch = case.batch()
    gradients = [training.aux_gradient(batch) for training in pair]
    steps = [training.advance(batch) for training in pair]
    problems = [
        f"{training.side.name}: the auxiliary losses ({', '.join(names)}) have no gradient: "
        "they reach the loss's value but train nothing (detached, or computed from no "
        "parameter)"
        for training, gradient in zip(pair, gradients, strict=True)
        if not any(np.any(host_array(g) != 0) for g in gradient.values())
    ]
    for training in pair:
        side = training.side.name
        for name in names:
            value = training.aux.get(name)
            if value is None:
                problems.append(
                    f"{name}: {side}'s train step added nothing to its loss (it was not sown, "
                    "or something removed it before the loss)"
                )
            elif float(value) == 0.0:
                problems.append(f"{name}: {side}'s train step added exactly 0 to its loss")
    fail_if_any(f"auxiliary losses on mesh {case.mesh.id}", problems)
    found = compare_trees(*(training.aux for training in pair))
    found += compare_trees(*({f"grads/{p}": g for p, g in grad.items()} for grad in gradients))
    if found:
        title = f"auxiliary losses of one train step and their gradient on mesh {case.mesh.id}"
        fail(failed(title, found))
    for training, (_, loss, _) in zip(pair, steps, strict=True):
        side = training.side
        logits = side.forward(training.initial, batch)[0]
        cross_entropy = mean_token_loss(logits, batch, case.family.logits_predict)
        expected = cross_entropy + aux_total(training.aux)
        found = compare_trees({"loss": expected}, {"loss": loss})
        if found:
            title = (
                f"{side.name}'s train-step loss is not its cross entropy plus its auxiliary "
                f"losses ({', '.join(names)}) on mesh {case.mesh.id}"
            )
            fail(failed(title, found, ("cross entropy + auxiliary", "train step")))
