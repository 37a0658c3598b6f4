"""The checks, as plain functions: each raises :class:`CheckFailure` with a full report.

The pytest suite is a thin layer over these, and the planted-fault tests call them
directly, so what a user sees in CI is exactly what the fault catalogue asserts on.
Every message starts with ``<family> <check>:`` and names leaf paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conformance.contract import Batch, Family, LogicalRules
from conformance.core.distributed import host_array
from conformance.core.numerics import (
    Mismatch,
    Tolerance,
    compare_arrays,
    compare_trees,
    report,
    tolerance_for,
)
from conformance.core.records import emit, emit_verdict, listening, measure
from conformance.core.sharding import (
    Logical,
    MeshSpec,
    UnknownLogicalAxis,
    indivisible,
    resolve_spec,
    spec_to_json,
)
from conformance.core.trees import (
    Flat,
    LeafSpec,
    PathMapError,
    check_bijection,
    map_paths,
    structure_diff,
)
from conformance.runtime.backends import (
    LinenRunner,
    NnxRunner,
    TransplantError,
    linen_runner,
    nnx_runner,
    transplant,
)
from conformance.runtime.diagnose.attribution import attribution_text, one_device
from conformance.runtime.diagnose.localise import Divergence, localise

BATCH_SIZE = 8
"""Rows per batch on device meshes: divisible by every default mesh's batch sharding."""

INIT_Z = 6.0
"""Init check bound: per-leaf means and stds may differ by this many standard errors."""


class CheckFailure(AssertionError):
    """A check found a divergence; the message is the full report."""


def fail(family: Family, check: str, message: str) -> NoReturn:
    """Raise :class:`CheckFailure` headed ``<family> <check>:``."""
    raise CheckFailure(f"{family.name} {check}: {message}")


def fail_if_any(family: Family, check: str, title: str, problems: Sequence[str]) -> None:
    """Fail with ``title`` and one indented line per problem, if there are any."""
    if problems:
        fail(family, check, f"{title}\n  " + "\n  ".join(problems))


def misplaced(arrays: Mapping[str, Any], shardings: Mapping[str, Any]) -> list[str]:
    """Arrays not placed as ``shardings`` asks, one line each: path, expected, actual."""
    return [
        f"{path}: expected {shardings[path].spec}, placed as {value.sharding}"
        for path, value in sorted(arrays.items())
        if not value.sharding.is_equivalent_to(shardings[path], value.ndim)
    ]


def param_map(family: Family, check: str, config: Any) -> dict[str, str]:
    """``{Linen param path: NNX param path}``, checked to be a bijection (else a failure)."""
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    try:
        mapping = map_paths(family.path_rules(config), linen.specs)
        check_bijection(mapping, nnx_.specs)
    except PathMapError as err:
        fail(family, check, str(err))
    return mapping


def check_structure(family: Family, config: Any) -> dict[str, Any]:
    """Both sides have the same leaves, shapes and dtypes after the path map.

    Returns the golden payload: leaf count, ``{nnx path: {shape, dtype}}``, and the
    NNX model's RNG stream variables, which have no Linen counterpart and which train
    states leave out (see :mod:`conformance.runtime.training`).
    """
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    rules = family.path_rules(config)
    mapping = map_paths(rules, linen.specs)
    linen_held = {map_paths(rules, [path])[path]: held for path, held in linen.held.items()}
    problems = structure_diff(linen.specs, nnx_.specs, mapping, linen_held, nnx_.held)
    counts = f"Linen {len(linen.specs)} leaves, NNX {len(nnx_.specs)} leaves"
    fail_if_any(family, "structure", f"{len(problems)} difference(s) ({counts})", problems)
    return {
        "leaf_count": len(nnx_.specs),
        "parameter_count": int(sum(np.prod(s.shape) for s in nnx_.specs.values())),
        "leaves": {p: {"shape": list(s.shape), "dtype": s.dtype} for p, s in nnx_.specs.items()},
        "nnx_rng_streams": nnx_.rng_streams,
    }


def resolve_all(
    family: Family,
    check: str,
    logical: Mapping[str, Logical],
    mesh: MeshSpec,
    rules: LogicalRules,
) -> dict[str, PartitionSpec]:
    """Resolve every leaf's logical names with ``rules`` on ``mesh``.

    Names no rule knows fail the check, each with its path.
    """
    resolved, unknown = {}, []
    for path, names in logical.items():
        try:
            resolved[path] = resolve_spec(names, rules, mesh)
        except UnknownLogicalAxis as err:
            unknown.append(f"{path}: logical axis {err.args[0]!r} has no rule")
    fail_if_any(family, check, "unknown logical axes", unknown)
    return resolved


def check_sharding(
    family: Family, config: Any, mesh: MeshSpec, devices: Mesh | None = None
) -> dict[str, Any]:
    """Both sides resolve to the same PartitionSpec per leaf, and every split is even.

    With ``devices``, both sides are also initialised on the mesh and every array is
    checked to be placed with its resolved spec. Returns the golden payload.
    """
    check = "sharding"
    if devices is not None:
        config = family.with_mesh(config, devices)
    rules = family.axis_rules(config)
    if devices is not None and tuple(rules) != tuple(family.logical_axis_rules()):
        fail(
            family,
            check,
            "axis_rules(config) of the device size differ from logical_axis_rules(), "
            "which every array placed on devices follows",
        )
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    mapping = param_map(family, check, config)
    linen_specs, nnx_specs = agreed_specs(family, check, linen, nnx_, mapping, mesh, rules)
    if devices is not None:
        _check_placement(family, linen, linen_specs, devices, "Linen")
        _check_placement(family, nnx_, nnx_specs, devices, "NNX")
    return {
        "mesh": dict(mesh.axes),
        "leaves": {
            dst: {
                "logical": list(nnx_.logical[dst] or ()),
                "spec": spec_to_json(nnx_specs[dst], len(nnx_.specs[dst].shape)),
            }
            for dst in sorted(nnx_specs)
        },
    }


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


class Sharded(Protocol):
    """One side's leaves: logical axis names and shapes, by path."""

    logical: Mapping[str, Logical]
    specs: Mapping[str, LeafSpec]


def agreed_specs(
    family: Family,
    check: str,
    linen: Sharded,
    nnx_: Sharded,
    mapping: Mapping[str, str],
    mesh: MeshSpec,
    rules: LogicalRules,
) -> tuple[dict[str, PartitionSpec], dict[str, PartitionSpec]]:
    """Both sides' specs resolved with ``rules``: equal per leaf and evenly split, or fail.

    Returns ``(Linen specs, NNX specs)``, each keyed by that side's paths.
    """
    linen_specs = resolve_all(family, check, linen.logical, mesh, rules)
    nnx_specs = resolve_all(family, check, nnx_.logical, mesh, rules)
    problems = []
    for src, dst in sorted(mapping.items(), key=lambda kv: kv[1]):
        if linen_specs[src] != nnx_specs[dst]:
            problems.append(
                f"{dst}: Linen {linen_specs[src]} (logical {linen.logical[src]}) != "
                f"NNX {nnx_specs[dst]} (logical {nnx_.logical[dst]})"
            )
        for dim, size, shards in indivisible(nnx_.specs[dst].shape, nnx_specs[dst], mesh):
            problems.append(
                f"{dst}: dim {dim} of size {size} is split {shards} ways by "
                f"{nnx_specs[dst]} on mesh {mesh.id}: not divisible"
            )
    fail_if_any(family, check, f"{len(problems)} problem(s) on mesh {mesh.id}", problems)
    return linen_specs, nnx_specs


def _check_placement(
    family: Family,
    runner: LinenRunner | NnxRunner,
    specs: Mapping[str, PartitionSpec],
    devices: Mesh,
    side: str,
) -> None:
    shardings = {p: NamedSharding(devices, s) for p, s in specs.items()}
    params = runner.init(0, shardings)
    fail_if_any(
        family, "sharding", f"{side} arrays placed off their specs", misplaced(params, shardings)
    )


def place_batch(family: Family, batch: Batch, mesh: MeshSpec, devices: Mesh) -> Batch:
    """``batch`` with its batch dimension sharded by the family's ``batch`` rule."""
    spec = resolve_spec((family.batch_axis, None), family.logical_axis_rules(), mesh)
    sharding = NamedSharding(devices, spec)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)


def shardings_for(
    family: Family, check: str, logical: Mapping[str, Logical], mesh: MeshSpec, devices: Mesh
) -> dict[str, NamedSharding]:
    """``{path: NamedSharding}`` from the logical names of one side (failures name ``check``).

    Resolved with :meth:`Family.logical_axis_rules`, as every array on devices is.
    """
    specs = resolve_all(family, check, logical, mesh, family.logical_axis_rules())
    return {path: NamedSharding(devices, spec) for path, spec in specs.items()}


def check_init(family: Family, config: Any, mesh: MeshSpec, devices: Mesh) -> None:
    """Per-leaf mean and std of the two sides' initial values agree within :data:`INIT_Z`.

    Values cannot agree (the backends draw random numbers differently); their
    distributions must. A leaf constant on one side must equal the other exactly.
    """
    config = family.with_mesh(config, devices)
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    mapping = param_map(family, "init", config)
    a = linen.init(0, shardings_for(family, "init", linen.logical, mesh, devices))
    b = nnx_.init(0, shardings_for(family, "init", nnx_.logical, mesh, devices))
    problems = []
    for src, dst in sorted(mapping.items(), key=lambda kv: kv[1]):
        x, y = host_array(a[src]).astype(np.float64), host_array(b[dst]).astype(np.float64)
        n = x.size
        (mx, sx), (my, sy) = (x.mean(), x.std()), (y.mean(), y.std())
        if sx == 0 or sy == 0:
            ok = sx == sy and mx == my
            bound = "exact (constant initialiser)"
        else:
            mean_se = np.sqrt((sx**2 + sy**2) / n)
            std_se = (sx + sy) / 2 / np.sqrt(n)
            ok = abs(mx - my) <= INIT_Z * mean_se and abs(sx - sy) <= INIT_Z * std_se
            bound = f"|dmean| <= {INIT_Z * mean_se:.3g}, |dstd| <= {INIT_Z * std_se:.3g}"
        if not ok:
            problems.append(
                f"{dst}: Linen mean={mx:.6g} std={sx:.6g}; NNX mean={my:.6g} std={sy:.6g}; "
                f"n={n}; allowed {bound}"
            )
    title = (
        f"{len(problems)} leaf initialiser(s) differ in distribution "
        f"(bound: {INIT_Z:g} standard errors)"
    )
    fail_if_any(family, "init", title, problems)


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """Logits and sown per-block hidden states of one side."""

    logits: jax.Array
    hidden: jax.Array | None


_NOT_SOWN = "per-block hidden states are not sown on both sides (an optional shortcut)"


def _first_divergent_block(first: ForwardResult, second: ForwardResult, tol: Any) -> str | None:
    """Localisation from the sown ``hidden_states``, when both sides sow them."""
    if first.hidden is None or second.hidden is None:
        return None
    for layer in range(first.hidden.shape[0]):
        found = compare_arrays(
            f"hidden_states[{layer}]", first.hidden[layer], second.hidden[layer], tol
        )
        if found is not None:
            return f"first divergent block: {layer} (output of decoder block {layer})\n  " + (
                found.describe()
            )
    return (
        "every block's output agrees: the divergence is after the last block (final norm or head)"
    )


def _measure_forward(
    title: str, a: ForwardResult, b: ForwardResult, tol: Tolerance, found: Mismatch | None
) -> None:
    """Emit each block's hidden-state error (when both sides sow them), then the logits'."""
    if not listening():
        return
    figure = f"forward: error per decoder block ({a.logits.dtype})"

    def where(x: str) -> dict[str, str]:
        return {"figure": figure, "series": title, "x": x}

    if a.hidden is not None and b.hidden is not None and a.hidden.shape == b.hidden.shape:
        for i in range(a.hidden.shape[0]):
            trees = {f"hidden_states[{i}]": a.hidden[i]}, {f"hidden_states[{i}]": b.hidden[i]}
            mismatches = compare_trees(*trees, tol)
            x = f"block {i}"
            emit(measure(f"{title}: {x}", *trees, mismatches, tolerance=tol, **where(x)))
    # The logits' verdict is the check's own (it may have used a wider reference).
    emit_verdict(
        f"{title}: logits", "logits", a.logits, b.logits, found, tolerance=tol, **where("logits")
    )


def check_forward(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    devices: Mesh,
    reference_config: Any | None = None,
) -> None:
    """Logits agree after transplanting Linen -> NNX and NNX -> Linen on ``devices``.

    Tolerance follows the policy for ``config``'s compute dtype. With
    ``reference_config`` (the same model in a wider dtype), an element outside
    tolerance passes when NNX is no farther than Linen from the wider Linen result.
    """
    config = family.with_mesh(config, devices)
    linen, nnx_ = linen_runner(family, config), nnx_runner(family, config)
    mapping = param_map(family, "forward", config)
    inverse = {v: k for k, v in mapping.items()}
    linen_sh = shardings_for(family, "forward", linen.logical, mesh, devices)
    nnx_sh = shardings_for(family, "forward", nnx_.logical, mesh, devices)
    batch = place_batch(family, family.batch(config, BATCH_SIZE), mesh, devices)
    nnx_own = nnx_.init(1, nnx_sh)
    linen_own = linen.init(0, linen_sh)
    directions = {
        "Linen params -> NNX": (linen_own, _moved(family, linen_own, mapping, nnx_, nnx_sh)),
        "NNX params -> Linen": (_moved(family, nnx_own, inverse, linen, linen_sh), nnx_own),
    }
    compared = []
    for direction, (linen_params, nnx_params) in directions.items():
        a = ForwardResult(*linen.forward(linen_params, batch))
        b = ForwardResult(*nnx_.forward(nnx_params, batch))
        tol = tolerance_for(a.logits.dtype)
        found = compare_arrays("logits", a.logits, b.logits, tol)
        if found is not None and reference_config is not None:
            ref = linen_runner(family, reference_config).forward(linen_params, batch)[0]
            found = compare_arrays("logits", a.logits, b.logits, tol, reference=ref)
        _measure_forward(f"{direction} on mesh {mesh.id}", a, b, tol, found)
        compared.append((direction, linen_params, nnx_params, a, b, tol, found))
    # Both directions are measured first; the first that disagrees is the verdict.
    for direction, linen_params, nnx_params, a, b, tol, found in compared:
        if found is None:
            continue
        rules = family.path_rules(config)
        found_module = localise(linen, nnx_, linen_params, nnx_params, batch, mapping, rules)
        where = found_module.describe() if isinstance(found_module, Divergence) else found_module
        if not isinstance(found_module, Divergence) or found_module.unpaired_inside:
            where += "\n  " + (_first_divergent_block(a, b, tol) or _NOT_SOWN)
        moved = forward_attribution(
            family, config, mesh, (a.logits, b.logits), (linen_params, nnx_params)
        )
        fail(
            family,
            "forward",
            report(f"{direction} on mesh {mesh.id}", [found], ("Linen", "NNX"))
            + f"\n  {where}\n  {moved}",
        )


def forward_attribution(
    family: Family,
    config: Any,
    mesh: MeshSpec,
    logits: tuple[Any, Any],
    params: tuple[Flat, Flat],
    quant: str | None = None,
    *,
    quantized: bool = False,
) -> str:
    """Which side's ``logits`` on ``mesh`` move when the forward runs on one device.

    ``logits`` are Linen's and NNX's from ``params`` (each side's own, for the Qwix
    mode ``quant`` when given); both forwards are rerun from the same parameters and
    batch on :func:`~conformance.runtime.diagnose.attribution.one_device`, so call it only
    on a failure.
    ``quantized`` (implied by ``quant``): the forward rounds to a quantization grid.
    Never raises (:func:`~conformance.runtime.diagnose.attribution.attribution_text`).
    """

    def on_one_device() -> tuple[Flat, Flat]:
        one = one_device(mesh)
        devices = one.devices()
        bound = family.with_mesh(config, devices)
        batch = place_batch(family, family.batch(bound, BATCH_SIZE), one, devices)
        results = []
        for runner, side_params in zip(
            (linen_runner(family, bound, quant), nnx_runner(family, bound, quant)),
            params,
            strict=True,
        ):
            shardings = shardings_for(family, "forward", runner.logical, one, devices)
            moved = transplant(side_params, {}, runner.specs, shardings)
            results.append({"logits": runner.forward(moved, batch)[0]})
        return results[0], results[1]

    return attribution_text(
        mesh,
        ("Linen", "NNX"),
        ({"logits": logits[0]}, {"logits": logits[1]}),
        on_one_device,
        quantized=quantized or quant is not None,
    )


def _moved(
    family: Family,
    params: Flat,
    mapping: Mapping[str, str],
    target: LinenRunner | NnxRunner,
    shardings: Mapping[str, NamedSharding],
) -> Flat:
    try:
        return transplant(params, mapping, target.specs, shardings)
    except TransplantError as err:
        fail(family, "forward", str(err))
