"""What the two sides are made of: leaves, shapes and dtypes, shardings, initialisers.

These checks compare layouts, not computations: they need no device for
``structure`` and the abstract ``sharding_topology``, and one sharded init per side
for ``sharding`` on a device mesh and ``init``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from conformance.checks.declare import ON_MESH, Axis, declare
from conformance.checks.kernel import agreed_specs, misplaced, paired, structure_problems
from conformance.contract import Backend, Bridges, Family, declared, required
from conformance.core.distributed import host_array
from conformance.core.failure import fail, fail_if_any
from conformance.core.sharding import spec_to_json
from conformance.core.trees import PathMapError, map_paths
from conformance.runtime.case import Case
from conformance.runtime.sides import Side, live_pair, live_sides

INIT_Z = 6.0
"""Init check bound: per-leaf means and stds may differ by this many standard errors."""


def _declares_bridges(family: Family) -> str | None:
    """Why ``family`` cannot run ``provenance``: it declares no :class:`Bridges`."""
    if declared(family, Bridges) is None:
        return f"{family.name} declares no bridged module counts (Bridges in features())"
    return None


@declare(
    (Axis.FAMILY, Axis.SIZE, Axis.SCAN_LAYERS, Axis.PAIR),
    where="none",
    devices=False,
    golden=True,
    pair=False,
)
def check_structure(case: Case) -> dict[str, Any]:
    """Both sides have the same leaves, shapes and dtypes in canonical paths and layouts.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis): a
    mode's rewrite must build what the other mode builds, but for the parameters its
    family accepts (``TreeMode(accept=...)``). Without Linen, only NNX's payload is
    compared, with the golden.

    Returns the golden payload of the last side: leaf count, ``{path: {shape, dtype}}``,
    and the NNX model's RNG stream variables, which have no Linen counterpart and which
    train states leave out (see :mod:`conformance.runtime.train_state`). A mode pair has
    no golden of its own: the two modes are compared with each other.
    """
    *others, last = live_sides(case)
    for side in others:
        try:
            rules = side.path_rules()
            held = {map_paths(rules, [p])[p]: kind for p, kind in side.runner.held.items()}
        except PathMapError as err:
            fail(f"what {side.name} holds beside its parameters: {err}")
        problems = structure_problems(
            (side, side.runner.specs, held), (last, last.runner.specs, last.runner.held)
        )
        counts = ", ".join(f"{s.name} {len(s.runner.specs)} leaves" for s in (side, last))
        fail_if_any(f"{len(problems)} difference(s) ({counts})", problems)
    specs = last.runner.specs
    return {
        "leaf_count": len(specs),
        "parameter_count": int(sum(np.prod(s.shape) for s in specs.values())),
        "leaves": {p: {"shape": list(s.shape), "dtype": s.dtype} for p, s in specs.items()},
        "nnx_rng_streams": last.runner.rng_streams,
    }


SIDE_BRIDGE = {Backend.LINEN: "ToLinen", Backend.NNX: "ToNNX"}
"""The bridge that runs the other backend's code inside each side, by backend id."""


@declare(
    (Axis.FAMILY, Axis.SCAN_LAYERS),
    where="none",
    devices=False,
    pair=False,
    requires=_declares_bridges,
)
def check_provenance(case: Case) -> None:
    """Each side runs as many bridged modules as the family declares (:class:`Bridges`).

    Counted in the models the other checks build (no extra trace): ``ToLinen`` modules in
    the Linen model, ``ToNNX`` modules in the NNX model. A side with more than declared
    runs the other backend's code, so agreeing numbers would compare a backend with
    itself.
    """
    expected = required(case.family, Bridges)
    problems = []
    for side in live_sides(case):
        kind = SIDE_BRIDGE[side.backend]
        built = side.runner.built
        found, want = built.bridged.get(kind, 0), expected.count(side.backend)
        if found != want:
            why = " (it runs the other backend's code)" if found > want else ""
            problems.append(
                f"{side.name} built {built.describe()}: {found} {kind} module(s), "
                f"the family declares {want}{why}"
            )
    fail_if_any("a side runs other code than declared", problems)


def _parameters(side: Side) -> tuple[Side, Mapping[str, Any], Mapping[str, Any]]:
    """The side with its parameters' logical names and shapes, in canonical paths."""
    return side, side.canonical(side.runner.logical), side.canonical(side.runner.specs)


@declare((*ON_MESH, Axis.PAIR), golden=True, pair=False, suite="sharding")
@declare(
    (Axis.FAMILY, Axis.FULL_SIZE, Axis.TOPOLOGY, Axis.SCAN_LAYERS),
    name="sharding_topology",
    where="topology",
    devices=False,
    golden=True,
    pair=False,
    suite="sharding",
)
def check_sharding(case: Case) -> dict[str, Any]:
    """Both sides resolve to the same PartitionSpec per leaf, and every split is even.

    The sides are Linen and NNX, or on a device mesh the NNX model in two modes (the
    ``pair`` axis), which have no golden of their own. Without Linen, NNX is compared
    with itself (every split even) and with the golden.

    On a device mesh, both sides are also initialised there and every array is checked
    to be placed with its resolved spec; on an abstract one (a production topology)
    nothing is allocated. Returns the golden payload.
    """
    family = case.family
    rules = family.axis_rules(case.config)
    if case.devices is not None and tuple(rules) != tuple(family.logical_axis_rules()):
        fail(
            "axis_rules(config) of the device size differ from logical_axis_rules(), "
            "which every array placed on devices follows"
        )
    sides = live_sides(case)
    last = sides[-1]
    paired(sides[0], last)
    specs = agreed_specs(_parameters(sides[0]), _parameters(last), rules=rules)[1]
    if case.devices is not None:
        for side in sides:
            _check_placement(side, side.case.specs(side.runner.logical, rules))
    return {
        "mesh": dict(case.mesh.axes),
        "leaves": {
            dst: {
                "logical": list(last.runner.logical[dst] or ()),
                "spec": spec_to_json(specs[dst], len(last.runner.specs[dst].shape)),
            }
            for dst in sorted(specs)
        },
    }


def _check_placement(side: Side, specs: Mapping[str, PartitionSpec]) -> None:
    shardings = {p: NamedSharding(side.case.devices, s) for p, s in specs.items()}
    params = side.runner.init(0, shardings)
    fail_if_any(f"{side.name} arrays placed off their specs", misplaced(params, shardings))


@declare((*ON_MESH, Axis.PAIR), suite="init")
def check_init(case: Case) -> None:
    """Per-leaf mean and std of the two sides' initial values agree within :data:`INIT_Z`.

    The sides are Linen and NNX, or the NNX model in two modes (the ``pair`` axis).
    Values need not agree (the backends draw random numbers differently, and a mode's
    rewrite may build its modules in another order); their distributions must. A leaf
    constant on one side must equal the other exactly.
    """
    first, second = live_pair(case)
    paired(first, second)
    a, b = first.canonical(first.init(0)), second.canonical(second.init(0))
    problems = []
    for dst in sorted(b):
        x, y = host_array(a[dst]).astype(np.float64), host_array(b[dst]).astype(np.float64)
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
                f"{dst}: {first.name} mean={mx:.6g} std={sx:.6g}; "
                f"{second.name} mean={my:.6g} std={sy:.6g}; n={n}; allowed {bound}"
            )
    title = (
        f"{len(problems)} leaf initialiser(s) differ in distribution "
        f"(bound: {INIT_Z:g} standard errors)"
    )
    fail_if_any(title, problems)
