"""From the check registry to pytest's tests: one planned test per family and combination.

Every test the plugin parametrizes is planned here, a registered check of the suite or
a user's own test over the plugin's axes alike: its id (the axis values' ids in
:data:`~conformance.checks.registry.AXES` order, then the check's own parameters), its
values, and its marks (a skip with the reason when the family lacks what the check
needs, else a strict xfail when the registry expects it to fail).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conformance.checks.registry import (
    AXES,
    Check,
    ExpectedFailure,
    Param,
    expected_failure,
)
from conformance.contract import (
    Backend,
    Family,
    Pair,
    layouts,
    preferred_layout,
    quantization_modes,
    recorded_backends,
    release,
    spelling,
    supports,
)
from conformance.core.references import MANIFEST, directory, references_root
from conformance.core.sharding import MeshSpec
from conformance.core.tpu import compiles
from conformance.pytest_plugin.session import DTYPES, LAYOUTS, Settings, settings
from conformance.runtime.quant import MODES

CASE = "conformance_case"
"""The parameter (a :class:`Planned`) of every registered suite check."""


class Group(NamedTuple):
    """Tests sharing compiled programs: one family's, in one layer layout, on one mesh."""

    family: str
    scan_layers: bool
    mesh: str

    def same_model(self, other: Group) -> bool:
        """Whether ``other`` builds the same model: the same family and layout."""
        return (self.family, self.scan_layers) == (other.family, other.scan_layers)


@dataclasses.dataclass(frozen=True, eq=False)
class Planned:
    """One test of a check on a family, as collected: its id, axis values and parameters."""

    check: Check
    family: Family
    id: str
    values: Mapping[str, Any]
    """Axis name -> value (``family``, ``mesh``, ``scan_layers``, ...)."""
    params: Mapping[str, Param]
    """The check's own parameters, by name."""
    parts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Each axis's and parameter's part of :attr:`id`, by name (empty for a zoo's own test)."""

    def __repr__(self) -> str:
        return self.id

    def facets(self) -> dict[str, Any]:
        """What a tier narrows by: the device mesh, layout, dtype id, mode, conversion.

        ``variant``: whether the check is a variant of the plain step or forward
        (:attr:`~conformance.checks.registry.Check.variant`); ``mode_pair``: whether it
        compares two modes of the NNX model
        (:attr:`~conformance.checks.registry.Check.mode_pair`, or a mode pair on the
        ``pair`` axis), in whatever layout and dtype it runs; ``costly_mode_pair``: a
        mode pair of a check whose mode pairs are costly
        (:attr:`~conformance.checks.registry.Check.costly_pairs`).
        """
        dtype_ids = {v: k for k, v in DTYPES.items()}
        found: dict[str, Any] = {
            "scan_layers": self.values.get("scan_layers"),
            "quant": self.values.get("quant"),
        }
        if self.check.mode_pair or self.pair != Pair.LINEN_NNX:
            found["mode_pair"] = True
        if self.check.costly_pairs and self.pair != Pair.LINEN_NNX:
            found["costly_mode_pair"] = True
        found["variant"] = self.check.variant
        if isinstance(mesh := self.values.get("mesh"), MeshSpec):
            found["mesh"] = mesh
        if "dtype" in self.values:
            found["dtype"] = dtype_ids.get(self.values["dtype"], "")
        if "layouts" in self.params:
            found["layouts"] = tuple(self.params["layouts"].value)
        if (compile_ := self.values.get("tpu")) is not None and compile_.target.production:
            # Production sizes compile in the layout production trains in, whatever the tier.
            if self.check.costly_production:
                found["costly_tpu_production"] = True
        elif compile_ is not None:
            found["scan_layers"] = compile_.scan_layers
        return {k: v for k, v in found.items() if v is not None}

    def expected(self) -> ExpectedFailure | None:
        """Why it is expected to fail, if it is (whether or not the family can run it)."""
        return expected_failure(self.check, self.family, self.by_name(), self.id, self.parts)

    def by_name(self) -> dict[str, Any]:
        """Each axis's and parameter's value, by name."""
        return {**self.values, **{name: p.value for name, p in self.params.items()}}

    @property
    def pair(self) -> Pair:
        """The sides it compares: its ``pair`` axis value, else Linen against NNX."""
        return self.values.get("pair", Pair.LINEN_NNX)

    @property
    def row(self) -> str:
        """Its row of the agreement matrix: the check's name, then a mode pair's id."""
        return f"{self.check.name} {self.pair.id}".rstrip()

    @property
    def has_golden(self) -> bool:
        """Whether it compares with a golden: its check has one, and it compares Linen with NNX.

        A mode pair compares the two modes with each other.
        """
        return self.check.golden and self.pair is Pair.LINEN_NNX

    @property
    def registered(self) -> bool:
        """Whether it is a registered check of the suite, not a user's own test."""
        return self.check.run is not None

    def root(self, run: Settings) -> Path:
        """The goldens directory it reads and writes (its family's, else the project's).

        A registered check of a family that ships its goldens uses the family's.
        """
        return run.goldens.of(self.family, suite=self.registered)

    def golden(self, run: Settings) -> Path | None:
        """Where its golden lives, ``<goldens>/<family>/<check>/<case>.json``, if it has one.

        A golden that depends on the platform (``Check.golden_by_platform``) lives at
        ``<goldens>/<family>/<check>/<platform>-xla-<level>/<primary mesh>-<case>.json``
        (``<case>.json`` when the case names its mesh),
        one compiled for a TPU slice (axis ``tpu``) at
        ``<goldens>/<family>/<check>/libtpu-<version>-xla-full/<case>.json``;
        a family with a :class:`~conformance.contract.Release` keeps its goldens in a
        folder of that release, ``<goldens>/<family>/<release>/<check>/...``.
        """
        if not self.has_golden:
            return None
        case = self.id.removeprefix(f"{self.family.name}-")
        folder = self.root(run) / self.family.name
        if (name := release(self.family)) is not None:
            folder /= name
        folder /= self.check.name
        if self.check.golden_by_platform:
            on = "" if "mesh" in self.values else f"{run.primary.id}-"
            return folder / run.platform / f"{on}{case}.json"
        if "tpu" in self.values:
            return folder / run.tpu_platform / f"{case}.json"
        return folder / f"{case}.json"

    def reference(self, run: Settings) -> Path | None:
        """The manifest of the recorded reference it compares with, if any."""
        recorded = self.values.get("recorded")
        if not self.check.references or recorded is None:
            return None
        return directory(references_root(self.root(run)), self.family.name, recorded) / MANIFEST

    def group(self, primary: MeshSpec) -> Group:
        """Its group of tests sharing programs: family, layout and device mesh.

        A test joins the layout it computes in (a conversion: its source's), else the
        family's preferred one; a test without a device mesh, or one that computes on
        the primary mesh what it then places on its own (a checkpoint saved there,
        restored here), the primary mesh.
        """
        scan = self.values.get("scan_layers")
        if scan is None and (compile_ := self.values.get("tpu")) is not None:
            scan = compile_.scan_layers
        if scan is None and "layouts" in self.params:
            scan = self.params["layouts"].value[0]
        if scan is None:
            scan = preferred_layout(self.family)
        mesh = self.values.get("mesh")
        if not isinstance(mesh, MeshSpec) or self.check.saved_on:
            mesh = primary
        return Group(self.family.name, bool(scan), mesh.id)


def _axis_values(name: str, family: Family, run: Settings, check: Check) -> list[Any]:
    """``(id, value)`` of each value of axis ``name`` for ``check`` on ``family``.

    A check that places nothing on devices has no pair whose sides need them
    (:attr:`~conformance.contract.Pair.on_devices`).
    """
    match name:
        case "family":
            return [(family.name, family)]
        case "size":
            return [(s, s) for s in family.sizes]
        case "full_size":
            return [(s, s) for s in family.sizes[1:]]
        case "mesh":
            return [(m.id, m) for m in run.meshes]
        case "topology":
            return [(m.id, m) for m in run.topologies]
        case "tpu":
            placed = run.placed.get(family.name)
            found = compiles(run.tpu, family.sizes, layouts(family), placed)
            return [(c.id, c) for c in found]
        case "scan_layers":
            return list(LAYOUTS.items())
        case "dtype":
            return list(DTYPES.items())
        case "recorded":
            backends = recorded_backends(family)
            return [(f"recorded-{b}", b) for b in backends] or [("recorded-none", None)]
        case "pair":
            return [(p.id, p) for p in Pair if check.devices or not p.on_devices]
        case "quant":
            modes = [
                m
                for m in sorted(quantization_modes(family))
                if check.quant_method is None or MODES[m].method == check.quant_method
            ]
            return [(m, m) for m in modes] or [("none", None)]
        case _:
            raise ValueError(f"unknown axis {name!r}; axes: {', '.join(AXES)}")


def plan(check: Check, family: Family, run: Settings) -> list[Planned]:
    """Every test of ``check`` on ``family``: the product of its axes and parameters."""
    axes = [_axis_values(name, family, run, check) for name in check.axes]
    params = [[(name, p) for p in values] for name, values in check.params]
    planned = []
    for combo in itertools.product(*axes, *params):
        chosen, own = combo[: len(axes)], combo[len(axes) :]
        ids = [i for i, _ in chosen] + [p.id for _, p in own]  # "" for Linen vs NNX
        values = {name: value for name, (_, value) in zip(check.axes, chosen, strict=True)}
        names = [*check.axes, *(name for name, _ in own)]
        parts = dict(zip(names, ids, strict=True))
        test_id = "-".join(i for i in ids if i)
        planned.append(Planned(check, family, test_id, values, dict(own), parts))
    return planned


def _because(family: Family, reason: str, *keys: str) -> str:
    """``reason``, followed by the family's ``unsupported`` words on ``keys``, if any."""
    why = "; ".join(family.unsupported[key] for key in keys if key in family.unsupported)
    return f"{reason}: {why}" if why else reason


def _layout_missing(family: Family, scan: bool) -> str | None:
    if scan in layouts(family):
        return None
    layout = "scan_layers" if scan else "a layer list"
    reason = f"{family.name} does not support {layout} (Layouts in features())"
    return _because(family, reason, "scan_layers")


def skip_reason(planned: Planned) -> str | None:
    """Why the family cannot run this test, in one line; ``None`` if it can.

    In order: the family is unavailable here, lacks a layer layout the test runs in or
    needs, declares no quantization mode of the check's method, has no Linen module for a
    test that runs one, keeps no recorded reference for a test that compares with one,
    lacks a capability (with its ``unsupported`` reason), or the check's own requirement
    says why not.
    """
    family, check = planned.family, planned.check
    if (reason := family.unavailable()) is not None:
        return f"{family.name}: {reason}"
    scan = planned.values.get("scan_layers")
    if scan is not None and (reason := _layout_missing(family, scan)):
        return reason
    if "quant" in planned.values and planned.values["quant"] is None:
        method = f"{check.quant_method} " if check.quant_method else ""
        declared = ", ".join(sorted(quantization_modes(family)))
        reason = f"{family.name} declares no {method}quantization mode"
        reason += f" (it declares {declared})" if declared else ""
        return _because(family, reason, "quantization")
    backend = planned.params.get("backend")
    pair = planned.pair
    if not family.has_linen and (
        (check.pair and pair == Pair.LINEN_NNX)
        or (backend is not None and backend.value == Backend.LINEN)
    ):
        reason = (
            f"{family.name} has no Linen module (Linen was deleted): its NNX side is "
            "compared with its recorded references (recorded_*) and its goldens"
        )
        return _because(family, reason, check.name)
    if "recorded" in planned.values and planned.values["recorded"] is None:
        reason = f"{family.name} keeps no recorded reference (Recorded in features())"
        return _because(family, reason, "recorded")
    params = planned.params.values()
    for layout in (*[s for p in params for s in p.layouts], *check.layouts):
        if (reason := _layout_missing(family, layout)) is not None:
            return reason
    wanted = [p.capability for p in params if p.capability] + [check.capability] * bool(
        check.capability
    )
    if pair.capability is not None:
        wanted.append(pair.capability)
    missing = [name for name in wanted if not supports(family, name)]
    if missing:
        declared = " or ".join(spelling(name) for name in missing)
        return _because(family, f"{family.name} does not declare {declared}", *missing)
    if check.requires is not None and (reason := check.requires(family)) is not None:
        return _because(family, reason, check.name)
    return None


def marks(planned: Planned) -> list[pytest.MarkDecorator]:
    """Its marks: ``golden``, ``variant`` (if the check is one), a skip or a strict xfail.

    The skip says :func:`skip_reason`; without one, a test expected to fail
    (:meth:`Planned.expected`) is a strict xfail.
    """
    found = [pytest.mark.golden] if planned.has_golden else []
    if planned.check.variant:
        found.append(pytest.mark.variant)
    if (reason := skip_reason(planned)) is not None:
        return [*found, pytest.mark.skip(reason=reason)]
    if (expected := planned.expected()) is not None:
        found.append(pytest.mark.xfail(reason=expected.reason, raises=expected.raises, strict=True))
    return found


def user_check(definition: pytest.Function, fixtures: Any) -> Check:
    """The :class:`Check` a user's own test describes: the axes it asks for and its marks.

    The markers ``golden``, ``variant``, ``capability(name)``, ``layouts(*scan_layers)``
    and ``quant_method(name)`` say what the registry says of a registered check.
    """
    capabilities = [m.args[0] for m in definition.iter_markers("capability")]
    methods = [m.args[0] for m in definition.iter_markers("quant_method")]
    return Check(
        name=check_name(definition),
        run=None,
        axes=tuple(a for a in AXES if a in fixtures),
        capability=capabilities[0] if capabilities else None,
        layouts=tuple(s for m in definition.iter_markers("layouts") for s in m.args),
        quant_method=methods[0] if methods else None,
        golden=definition.get_closest_marker("golden") is not None,
        variant=definition.get_closest_marker("variant") is not None,
    )


def check_name(item: Any) -> str:
    """The check a test implements: its function's name without ``test_``."""
    return item.originalname.removeprefix("test_") if isinstance(item, pytest.Function) else ""


def planned_of(item: pytest.Item | None) -> Planned | None:
    """The :class:`Planned` test ``item`` runs; ``None`` for a test the plugin did not plan."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    if isinstance(found := callspec.params.get(CASE), Planned):
        return found
    family = callspec.params.get("family")
    if not isinstance(family, Family):
        return None
    check = user_check(item, callspec.params)
    values = {a: callspec.params[a] for a in check.axes}
    return Planned(check, family, callspec.id, values, {})


def group_of(item: pytest.Item | None) -> Group | None:
    """The group of a planned test; ``None`` for anything else."""
    planned = planned_of(item)
    if planned is None:
        return None
    return planned.group(settings(item.config).primary)
