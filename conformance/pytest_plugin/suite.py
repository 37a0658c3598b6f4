"""The plugin's hooks and fixtures of a conformance run: parametrize, collect, run, report.

Registered by :func:`conformance.pytest_plugin.parts.register` in a conformance run
only, so a host project's own run never sees these fixtures. A registered check of the
suite takes one parameter, :data:`~conformance.pytest_plugin.plan.CASE` (its
:class:`~conformance.pytest_plugin.plan.Planned` test), and its fixture runs the check;
a user's own test asking for the plugin's axes (``family``, ``mesh``, ``scan_layers``,
...) is parametrized over them the same way.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from conformance.checks import registry
from conformance.contract import FirstEditionWarning, first_edition_features
from conformance.core import distributed
from conformance.core.failure import CheckFailure
from conformance.core.references import references_root
from conformance.core.roots import GoldensError
from conformance.core.sharding import InsufficientDevices, MeshSpec
from conformance.pytest_plugin import options
from conformance.pytest_plugin.divergences import divergence_problems, first_edition_spellings
from conformance.pytest_plugin.goldens import WRITTEN, Golden
from conformance.pytest_plugin.matrix import CLAIMED
from conformance.pytest_plugin.plan import (
    CASE,
    Planned,
    check_name,
    group_of,
    marks,
    plan,
    planned_of,
    user_check,
)
from conformance.pytest_plugin.session import Settings, settings
from conformance.pytest_plugin.tiers import Tier
from conformance.report.model import AREA
from conformance.runtime.case import Case

_COLLECTED = pytest.StashKey[set[str]]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The tier, the meshes and the XLA optimisation level the run uses."""
    return settings(config).header()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse the run, before any test or worker, if a zoo's check cannot register."""
    if problems := registry.installed().problems:
        raise pytest.UsageError("; ".join(problems))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize a suite check from the registry, or a user's test over its axes."""
    run = settings(metafunc.config)
    if CASE in metafunc.fixturenames:
        check = registry.get(check_name(metafunc.definition))
        planned = [p for family in run.families for p in plan(check, family, run)]
        params = [pytest.param(p, id=p.id, marks=[*marks(p), _worker(p, run)]) for p in planned]
        metafunc.parametrize(CASE, params, indirect=True)
        return
    if "family" not in metafunc.fixturenames:
        return
    check = user_check(metafunc.definition, metafunc.fixturenames)
    planned = [p for family in run.families for p in plan(check, family, run)]
    params = [pytest.param(*p.values.values(), id=p.id, marks=marks(p)) for p in planned]
    metafunc.parametrize(list(check.axes), params)


def _worker(planned: Planned, run: Any) -> pytest.MarkDecorator:
    """Keep a group's tests on one pytest-xdist worker (``--dist loadgroup``)."""
    return pytest.mark.xdist_group("/".join(map(str, planned.group(run.primary))))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Claim goldens, apply the tier, and group the tests.

    Runs before -k/-m deselection on purpose: every generated test claims its golden,
    so neither a tier nor -k makes another test's golden look unused. The tests kept
    are ordered so that those sharing compiled programs (same family, layout and mesh)
    run together; see :class:`~conformance.pytest_plugin.scopes.ScopePerGroup`.
    """
    run = settings(config)
    config.stash[_COLLECTED] = set()
    kept, left_out = [], []
    for item in items:
        planned = planned_of(item)
        if planned is None and CASE in getattr(item, "fixturenames", ()):
            left_out.append(item)  # a check with nothing to run on (tpu_compile without --tpu)
            continue
        if planned is None:
            kept.append(item)
            continue
        config.stash[_COLLECTED].add(planned.family.name)
        try:
            claims = (planned.golden(run), planned.reference(run))
        except GoldensError as err:  # a user's golden test in a run with no project
            raise pytest.UsageError(f"{item.nodeid}: {err}") from None
        config.stash[CLAIMED].update(path for path in claims if path is not None)
        item.user_properties.append(("conformance", (planned.family.name, planned.row)))
        item.user_properties.append((AREA, planned.check.area))
        (left_out if tier_leaves_out(run.tier, planned, item) else kept).append(item)
    _refuse_unknown_divergences(run, items)
    _warn_first_edition(run)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    families = {f.name: i for i, f in enumerate(run.families)}
    meshes = {m.id: i for i, m in enumerate(run.meshes)}

    def rank(item: pytest.Item) -> tuple[Any, ...]:
        group = group_of(item)
        if group is None:
            return (-1,)
        family, scan, mesh = group
        return (families.get(family, len(families)), scan, meshes.get(mesh, len(meshes)))

    items[:] = sorted(kept, key=rank)


def _refuse_unknown_divergences(run: Settings, items: list[pytest.Item]) -> None:
    """A usage error for a known divergence that names no check or no test id.

    The run's own tests (a zoo's, over the plugin's axes) count as checks too.
    """
    own: dict[str, list[Planned]] = {}
    registered = registry.checks()
    for item in items:
        if (planned := planned_of(item)) is not None and planned.check.name not in registered:
            own.setdefault(planned.check.name, []).append(planned)
    problems = [line for family in run.families for line in divergence_problems(family, run, own)]
    if problems:
        raise pytest.UsageError("; ".join(problems))
    for family in run.families:
        if spellings := first_edition_spellings(family, run):
            warnings.warn(
                FirstEditionWarning(
                    f"family {family.name!r} declares known_divergences as "
                    "{'check[id fragment]': reason}, the first edition's spelling; write "
                    "a tuple of Divergence values: " + "; ".join(spellings)
                ),
                stacklevel=1,
            )


def _warn_first_edition(run: Settings) -> None:
    """One :class:`FirstEditionWarning` per family declaring abilities as the first edition did.

    It still works; the warning gives each declaration's second-edition spelling.
    """
    for family in run.families:
        if spellings := first_edition_features(family):
            warnings.warn(
                FirstEditionWarning(
                    f"family {family.name!r} declares abilities in the first edition's "
                    "spelling (Capabilities flags with hooks); list them in features(): "
                    + "; ".join(spellings)
                ),
                stacklevel=1,
            )


def tier_leaves_out(tier: Tier, planned: Planned, item: pytest.Item) -> str:
    """Why ``tier`` leaves out ``item`` (``""`` if it runs it).

    A tier without expected failures leaves out every test expected to fail, whether or
    not its family could run it here.
    """
    expected = planned.expected() is not None or item.get_closest_marker("xfail") is not None
    if not tier.expected_failures and expected:
        return "expected to fail"
    return tier.leaves_out(planned.family, planned.facets())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop with a usage error if the selection removed every test of a chosen family."""
    config = session.config
    run = settings(config)
    chosen = {f.name for f in run.families}
    collected = config.stash.get(_COLLECTED, set())
    running = {p.family.name for item in session.items if (p := planned_of(item)) is not None}
    emptied = sorted((collected & chosen) - running)
    if emptied:
        how = f"tier {run.tier.name!r}"
        for flag, option in (("-k", "keyword"), ("-m", "markexpr")):
            if value := config.getoption(option):
                how += f" and {flag} {value!r}"
        pytest.exit(
            f"the selection ({how}) removed every test of {', '.join(emptied)}; "
            "widen it or narrow --conformance-family",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


SUITE = Path(__file__).parents[1] / "suite"
"""Where the suite's test modules live: the place every skip of theirs is reported at."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Show a :class:`CheckFailure` as its report alone: the message is the product.

    A registered check's skip is reported at the suite, not at its module, so pytest's
    summary folds every skip of one reason into one line with its count. An expected
    failure that fails without the words its divergence shows is a failure, saying so;
    one that fails with them names, beside its reason, the failure that stood for it.
    """
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(CheckFailure):
        report.longrepr = str(call.excinfo.value)
    planned = planned_of(item)
    if call.excinfo is not None and hasattr(report, "wasxfail") and planned is not None:
        failure = f"{call.excinfo.typename}: {call.excinfo.value}"
        expected = planned.expected()
        if expected is not None and (why := expected.unshown(failure)):
            report.outcome, report.longrepr = "failed", why
            del report.wasxfail
        else:
            report.wasxfail = f"{report.wasxfail} (failed: {_first_line(failure)})"
    if report.skipped and isinstance(report.longrepr, tuple) and planned and planned.registered:
        report.longrepr = (str(SUITE), None, report.longrepr[2])
    return report


def _first_line(text: str, limit: int = 160) -> str:
    """The first line of ``text``, cut to ``limit`` characters with an ellipsis."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def progress_label(item: pytest.Item) -> str:
    """``family layout mesh check`` for a progress line, aligned in columns.

    A TPU compile shows its slice (``v5p-4x4x4``) where the mesh would be.
    """
    group = group_of(item)
    if group is None:
        return f"{check_name(item):<22}"
    family, scan, mesh = group
    planned = planned_of(item)
    if planned is not None and (compile_ := planned.values.get("tpu")) is not None:
        mesh = compile_.target.topology.id
    return f"{family:<17} {'scan' if scan else 'loop'} {mesh:<20} {check_name(item):<22}"


class Bound:
    """A registered check bound to its case and parameters, ready to run."""

    def __init__(
        self, check: registry.Check, case: Case, params: dict[str, Any], golden: Golden | None
    ) -> None:
        self.check, self.case, self.params, self.golden = check, case, params, golden

    def run(self) -> None:
        """Run the check; compare what it returns with its golden, if it has one."""
        payload = self.check(self.case, **self.params)
        if self.golden is not None:
            self.golden.check(payload)


def _devices_or_skip(mesh: MeshSpec) -> Any:
    try:
        return mesh.devices()
    except InsufficientDevices as err:
        pytest.skip(str(err))


@pytest.fixture
def conformance_case(request: pytest.FixtureRequest) -> Bound:
    """The registered check of the requesting suite test, bound to its case.

    The case is placed on its mesh's devices (the test skips, saying why, when there are
    too few); a check that writes files gets a directory every process shares, and one
    with goldens its :class:`~conformance.pytest_plugin.goldens.Golden`.
    """
    planned: Planned = request.param
    check, run = planned.check, settings(request.config)
    mesh = registry.mesh_of(check, planned.values, run.primary)
    devices = _devices_or_skip(mesh) if check.devices and mesh is not None else None
    case = registry.case_of(check, planned.values, mesh, devices)
    params = {name: param.value for name, param in planned.params.items()}
    params.update({axis: planned.values[axis] for axis in check.given})
    if check.saved_on:
        params["saved_on"] = case.on(run.primary, _devices_or_skip(run.primary))
    if check.workdir:
        params["workdir"] = request.getfixturevalue("shared_tmp_path")
    if check.references:
        params["recorded"] = planned.values["recorded"]
        params["references"] = references_root(planned.root(run))
    golden = request.getfixturevalue("golden") if planned.has_golden else None
    return Bound(check, case, params, golden)


@pytest.fixture
def golden(request: pytest.FixtureRequest, snapshot: Any) -> Golden:
    """The :class:`~conformance.pytest_plugin.goldens.Golden` of the requesting test.

    A user's own test must be marked ``golden``; a registered check has one when the
    registry says so.
    """
    planned = planned_of(request.node)
    run = settings(request.config)
    path = None if planned is None else planned.golden(run)
    if planned is None or path is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses `golden` without @pytest.mark.golden")
    root = planned.root(run)
    update = bool(request.config.option.update_snapshots)
    elsewhere = update and not distributed.is_leader()
    family, check = planned.family.name, planned.check.name
    written = request.config.stash.setdefault(WRITTEN, set())
    compile_ = planned.values.get("tpu")
    options = "" if compile_ is None else f"--tpu {compile_.target.spec} "
    return Golden(
        snapshot,
        root,
        path,
        update,
        elsewhere,
        family=family,
        check=check,
        written=written,
        options=options,
    )


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh directory for the test that every process of the run reads and writes.

    With one process it is ``tmp_path``. In a multi-controller run it lies under
    ``--conformance-shared-dir`` (the test skips, saying so, without one), named after
    the test, emptied by process 0 before any process uses it.
    """
    if not distributed.is_multiprocess():
        return tmp_path
    root = options.value(request.config, "shared-dir")
    if root is None:
        pytest.skip(
            "a multi-controller run writes checkpoints to a directory every process can "
            "read: give one with --conformance-shared-dir"
        )
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    # Only word characters: orbax globs inside the directory, and `[` would be a pattern.
    name = re.sub(r"\W", "_", request.node.name)[:60]
    path = Path(root).resolve() / f"{name}-{digest}"
    if distributed.is_leader():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    distributed.barrier(f"shared_tmp_path {digest}")
    return path


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> Tier:
    """The run's :class:`~conformance.pytest_plugin.tiers.Tier` (``--tier``)."""
    return settings(request.config).tier


@pytest.fixture
def device_mesh(mesh: MeshSpec) -> Any:
    """The device mesh for ``mesh``; skips with the reason if there are too few devices."""
    return _devices_or_skip(mesh)


@pytest.fixture
def primary_mesh(request: pytest.FixtureRequest) -> tuple[MeshSpec, Any]:
    """The run's primary mesh and its devices, for checks that need only one mesh."""
    mesh = settings(request.config).primary
    return mesh, _devices_or_skip(mesh)
