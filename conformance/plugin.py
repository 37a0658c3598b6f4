"""The pytest plugin: options, parametrization, tiers, fixtures, goldens, the matrix.

Registered through the ``pytest11`` entry point, so any project with this package
installed can run the suite on its own families: ``pytest --pyargs conformance.suite``.
It also bounds a long run's memory: tests that share compiled programs run together,
and their :class:`~conformance.core.scope.Scope` is released when the group changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import conformance.suite
from conformance import contract as registry
from conformance.checks import CheckFailure
from conformance.core import distributed, scope
from conformance.core.environment import XLA_OPT_LEVELS, configure_host_platform, set_xla_opt
from conformance.core.goldens import SUFFIX, GoldenError, GoldenExtension, golden_path, load
from conformance.core.sharding import InsufficientDevices, MeshSpec, MeshSpecError, parse_mesh
from conformance.processes import MultiController
from conformance.progress import CompileClock, Progress
from conformance.report.collector import ReportCollector
from conformance.report.model import header as report_header
from conformance.report.model import matrix_rows
from conformance.runtime.quant import MODES
from conformance.tiers import DEFAULT_TIER, TIERS, Tier, TierError, get_tier

DEFAULT_MESHES = ("data=2,fsdp=2,tensor=2", "fsdp=8")
DEFAULT_TOPOLOGIES = ("4x4x4", "4x8x8")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
LAYOUTS = {"loop": False, "scan": True}

_FAMILIES = pytest.StashKey[list[registry.Family]]()
_MESHES = pytest.StashKey[dict[str, list[MeshSpec]]]()
_CLAIMED = pytest.StashKey[set[Path]]()
_TIER = pytest.StashKey[Tier]()
_COLLECTED = pytest.StashKey[set[str]]()
_ACTIVE = pytest.StashKey[bool]()


OPTION_PREFIX = "--conformance-"
"""Every command-line option of the plugin starts with this, so none can clash with a host
project's own; ``python -m conformance`` also takes them without the prefix."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Declare the ``--conformance-*`` options and the ``conformance_*`` ini options."""
    group = parser.getgroup("conformance", "Linen/NNX conformance")
    group.addoption(
        "--conformance-family",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this family, or the families a glob such as 'maxtext-*' matches "
        "(repeatable); default: every registered family",
    )
    group.addoption(
        "--conformance-mesh",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"device mesh to run on (repeatable); default: {' and '.join(DEFAULT_MESHES)}",
    )
    group.addoption(
        "--conformance-topology",
        action="append",
        default=[],
        metavar="SPEC",
        help="abstract production mesh for full-size sharding goldens (repeatable); "
        f"default: {' and '.join(DEFAULT_TOPOLOGIES)}",
    )
    group.addoption(
        "--conformance-tier",
        default=DEFAULT_TIER,
        metavar="NAME",
        help="how much of the suite to run: "
        + "; ".join(f"{t.name}: {t.summary}" for t in TIERS.values())
        + f" (default: {DEFAULT_TIER})",
    )
    group.addoption(
        "--conformance-xla-opt",
        default="low",
        choices=XLA_OPT_LEVELS,
        help="XLA optimisation level: low (most passes off, compiles several times faster; "
        "the default) or full (as production code compiles, for a nightly job)",
    )
    group.addoption(
        "--conformance-report",
        default=None,
        metavar="DIR",
        help="write report.json, report.md, report.html (with divergence plots) and "
        "junit.xml to DIR, merged with the reports of other processes writing there",
    )
    group.addoption(
        "--conformance-progress",
        action="store_true",
        help="print one line per family x check as it runs instead of a character per test",
    )
    group.addoption(
        "--conformance-distributed",
        action="store_true",
        help="join a multi-controller run (one process per host) that JAX detects itself, "
        "as on a TPU pod slice: run the same command on every host",
    )
    group.addoption(
        "--conformance-coordinator",
        default=None,
        metavar="HOST:PORT",
        help="join a multi-controller run whose process 0 serves at HOST:PORT (with "
        "--conformance-num-processes and --conformance-process-id)",
    )
    group.addoption("--conformance-num-processes", type=int, default=None, metavar="N")
    group.addoption("--conformance-process-id", type=int, default=None, metavar="I")
    group.addoption(
        "--conformance-connect-timeout",
        type=int,
        default=300,
        metavar="SECONDS",
        help="how long a process waits for the coordinator and the others (default: 300)",
    )
    group.addoption(
        "--conformance-shared-dir",
        default=None,
        metavar="DIR",
        help="a directory every process of a multi-controller run can read and write, for "
        "checkpoints (their tests skip without one); default: pytest's tmp_path",
    )
    parser.addini("conformance_goldens", "directory of golden files", default="goldens")
    parser.addini(
        "conformance_builtin_families",
        "run the families this package ships (gpt3, llama, maxtext-*) when no "
        "--conformance-family is given",
        type="bool",
        default=True,
    )


def _option(config: pytest.Config, name: str) -> Any:
    return config.getoption(f"conformance_{name}")


def selects_suite(config: pytest.Config) -> bool:
    """Whether this run is a conformance run: the plugin acts only then.

    It is when a ``--conformance-*`` option is given, when an argument (a path, or a
    module with ``--pyargs``) lies inside ``conformance.suite``, or when the run is in a
    source checkout of this project (its rootdir holds the suite, not installed).
    Any other pytest run in an environment with this package installed is left alone:
    no XLA flags, no devices, no parametrization, no report.
    """
    defaults = {"family": [], "mesh": [], "topology": [], "tier": DEFAULT_TIER}
    defaults |= {"xla_opt": "low", "progress": False, "report": None}
    defaults |= {"distributed": False, "coordinator": None, "shared_dir": None}
    if any(_option(config, name) != default for name, default in defaults.items()):
        return True
    suite = Path(conformance.suite.__file__).parent
    installed = "site-packages" in suite.parts
    if not installed and config.rootpath in suite.parents:
        return True
    for arg in config.args:
        path = _arg_path(config, arg.split("::")[0])
        if path is None:
            continue
        if path == suite or suite in path.parents:
            return True
    return False


def _arg_path(config: pytest.Config, arg: str) -> Path | None:
    if config.option.pyargs:
        try:
            spec = importlib.util.find_spec(arg)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin is not None:
            origin = Path(spec.origin)
            return origin.parent if origin.name == "__init__.py" else origin
    base = (
        config.rootpath
        if config.args_source == pytest.Config.ArgsSource.TESTPATHS
        else (config.invocation_params.dir)
    )
    return (base / arg).resolve()


def pytest_configure(config: pytest.Config) -> None:
    """Validate the options (a usage error lists valid values) and set up a conformance run.

    Does nothing to a run that does not select the suite (:func:`selects_suite`).
    """
    config.addinivalue_line("markers", "golden: the test compares against a golden file")
    config.addinivalue_line(
        "markers",
        "capability(name): run only on families whose Capabilities declare it (else skip)",
    )
    config.addinivalue_line(
        "markers",
        "layouts(*scan_layers): run only on families supporting each of these layer layouts "
        "(True: scanned), else skip",
    )
    config.addinivalue_line(
        "markers", "quant_method(name): parametrize `quant` only over modes of this method"
    )
    config.addinivalue_line(
        "markers",
        "known_failure(reason_of): reason_of(**params) gives why a case fails with the pinned "
        "libraries (a strict xfail), or None",
    )
    try:
        tier = get_tier(_option(config, "tier"))
    except TierError as err:
        raise pytest.UsageError(str(err)) from None
    config.stash[_TIER] = tier
    config.stash[_ACTIVE] = selects_suite(config)
    if not config.stash[_ACTIVE]:
        return
    configure_host_platform()
    cluster = _cluster(config)
    if cluster is not None:
        try:
            distributed.initialize(cluster)
        except distributed.DistributedError as err:
            raise pytest.UsageError(str(err)) from None
    set_xla_opt(_option(config, "xla_opt"))
    try:
        builtin = bool(config.getini("conformance_builtin_families"))
        config.stash[_FAMILIES] = registry.select(
            _option(config, "family"), include_builtin=builtin
        )
        config.stash[_MESHES] = {
            "mesh": [parse_mesh(s) for s in _option(config, "mesh") or DEFAULT_MESHES],
            "topology": [parse_mesh(s) for s in _option(config, "topology") or DEFAULT_TOPOLOGIES],
        }
    except (registry.FamilyError, MeshSpecError) as err:
        raise pytest.UsageError(str(err)) from None
    if _option(config, "mesh"):
        config.stash[_TIER] = dataclasses.replace(tier, meshes=None)
    config.stash[_CLAIMED] = set()
    leader = distributed.is_leader()
    if distributed.is_multiprocess():
        config.pluginmanager.register(MultiController(), "conformance-processes")
    config.pluginmanager.register(SessionReport(config), "conformance-report")
    config.pluginmanager.register(ScopePerGroup(), "conformance-scopes")
    config.pluginmanager.register(CompileClock(), "conformance-compiles")
    if (directory := _option(config, "report")) is not None:
        header = report_header(
            tier.name,
            [m.id for m in run_meshes(config)],
            _option(config, "xla_opt"),
            [f.name for f in config.stash[_FAMILIES]],
        )
        command = [str(config.invocation_params.dir), *config.invocation_params.args]
        collector = ReportCollector(Path(directory).resolve(), header, command, writes=leader)
        config.pluginmanager.register(collector, "conformance-report-files")
    if _option(config, "progress"):
        header = _header(config) if config.option.verbose < 0 else []
        progress = Progress(header, _progress_label)
        config.pluginmanager.register(progress, "conformance-progress")


def _cluster(config: pytest.Config) -> distributed.Cluster | None:
    """The multi-controller run the options ask this process to join, if any."""
    coordinator = _option(config, "coordinator")
    if coordinator is None and not _option(config, "distributed"):
        return None
    return distributed.Cluster(
        coordinator,
        _option(config, "num_processes"),
        _option(config, "process_id"),
        _option(config, "connect_timeout"),
    )


def active(config: pytest.Config) -> bool:
    """Whether the plugin acts on this run (see :func:`selects_suite`)."""
    return config.stash.get(_ACTIVE, False)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The tier, the meshes and the XLA optimisation level a conformance run uses."""
    return _header(config) if active(config) else []


def _header(config: pytest.Config) -> list[str]:
    tier = config.stash[_TIER]
    meshes = ", ".join(m.id for m in run_meshes(config))
    kept = [
        f"meshes {meshes}",
        "one layer layout per family" if tier.one_layout else "every layer layout",
        "dtypes " + ", ".join(tier.dtypes or DTYPES),
        "one quantization mode per method" if tier.one_mode_per_method else "every mode",
        "expected failures run" if tier.expected_failures else "expected failures left out",
    ]
    families = ", ".join(f.name for f in config.stash[_FAMILIES]) or "none"
    return [
        f"conformance: tier {tier.name} ({tier.summary}): " + "; ".join(kept),
        f"conformance: families {families}; XLA optimisation {_option(config, 'xla_opt')}; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)",
    ]


def _progress_label(item: pytest.Item) -> str:
    """``family layout mesh check`` for a progress line, aligned in columns."""
    group = group_of(item)
    if group is None:
        return f"{check_name(item):<22}"
    family, scan, mesh = group
    return f"{family:<17} {'scan' if scan else 'loop'} {mesh:<20} {check_name(item):<22}"


def run_meshes(config: pytest.Config) -> list[MeshSpec]:
    """The device meshes this run's tier keeps, the primary one first."""
    configured = config.stash[_MESHES]["mesh"]
    return config.stash[_TIER].mesh_order(configured) or configured


def goldens_root(config: pytest.Config) -> Path:
    """The goldens directory, relative to the rootdir unless absolute."""
    return config.rootpath / config.getini("conformance_goldens")


AXES = ("family", "size", "full_size", "mesh", "topology", "scan_layers", "dtype", "quant")
"""Parameters the plugin generates, in test-id order, for any test that asks for them."""


def _axis_values(name: str, family: registry.Family, config: pytest.Config) -> list[Any]:
    meshes = config.stash[_MESHES]
    match name:
        case "family":
            return [(family.name, family)]
        case "size":
            return [(s, s) for s in family.sizes]
        case "full_size":
            return [(s, s) for s in family.sizes[1:]]
        case "mesh" | "topology":
            return [(m.id, m) for m in meshes[name]]
        case "scan_layers":
            return list(LAYOUTS.items())
        case _:
            return list(DTYPES.items())


def _quant_values(family: registry.Family, methods: set[str]) -> list[Any]:
    """The family's quantization modes, narrowed to ``methods`` if any."""
    modes = [
        name
        for name in sorted(family.capabilities.quantization)
        if not methods or MODES[name].method in methods
    ]
    return [(m, m) for m in modes] or [("none", None)]


def _marks(
    family: registry.Family,
    case: dict[str, Any],
    methods: set[str],
    known: list[Callable[..., str | None]],
) -> list[pytest.MarkDecorator]:
    skips = _skips(family, case, methods)
    if skips:
        return skips
    reasons = [r for reason_of in known if (r := reason_of(**case))]
    return [pytest.mark.xfail(reason=r, raises=CheckFailure, strict=True) for r in reasons]


def _layout_missing(family: registry.Family, scan: bool) -> str | None:
    if scan in family.capabilities.scan_layers:
        return None
    layout = "scan_layers" if scan else "a layer list"
    return f"{family.name} does not support {layout} (Capabilities.scan_layers)"


def _skips(
    family: registry.Family, case: dict[str, Any], methods: set[str]
) -> list[pytest.MarkDecorator]:
    if (reason := family.unavailable()) is not None:
        return [pytest.mark.skip(reason=f"{family.name}: {reason}")]
    scan = case.get("scan_layers")
    if scan is not None and (reason := _layout_missing(family, scan)):
        return [pytest.mark.skip(reason=reason)]
    if "quant" in case and case["quant"] is None:
        wanted = "/".join(sorted(methods)) + " " if methods else ""
        declared = ", ".join(sorted(family.capabilities.quantization))
        reason = f"{family.name} declares no {wanted}quantization mode"
        reason += f" (it declares {declared})" if declared else ""
        return [pytest.mark.skip(reason=reason)]
    return []


def capability_skip(family: registry.Family, item: pytest.Item) -> str | None:
    """Why ``family`` cannot run ``item``: a ``capability`` or ``layouts`` it lacks.

    The markers may sit on the test, its module or one of its parameters.
    """
    for mark in item.iter_markers("layouts"):
        for scan in mark.args:
            if (reason := _layout_missing(family, scan)) is not None:
                return reason
    missing = [
        m.args[0]
        for m in item.iter_markers("capability")
        if not getattr(family.capabilities, m.args[0])
    ]
    if not missing:
        return None
    declared = ", ".join(f"{name}=True" for name in missing)
    why = "; ".join(family.unsupported[name] for name in missing if name in family.unsupported)
    reason = f"{family.name} does not declare Capabilities({declared})"
    return f"{reason}: {why}" if why else reason


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize a test over every valid combination of the :data:`AXES` it requests."""
    if "family" not in metafunc.fixturenames or not active(metafunc.config):
        return
    argnames = [a for a in AXES if a in metafunc.fixturenames]
    methods = {m.args[0] for m in metafunc.definition.iter_markers("quant_method")}
    known = [m.args[0] for m in metafunc.definition.iter_markers("known_failure")]
    params = []
    for family in metafunc.config.stash[_FAMILIES]:
        axes = [_axis_values(name, family, metafunc.config) for name in argnames]
        if "quant" in argnames:
            axes[argnames.index("quant")] = _quant_values(family, methods)
        for combo in itertools.product(*axes):
            case = {name: value for name, (_, value) in zip(argnames, combo, strict=True)}
            case_id = "-".join(i for i, _ in combo)
            marks = _marks(family, case, methods, known)
            params.append(pytest.param(*case.values(), id=case_id, marks=marks))
    metafunc.parametrize(argnames, params)


def check_name(item: pytest.Item) -> str:
    """The check a suite test implements: its function name without ``test_``."""
    return item.originalname.removeprefix("test_") if isinstance(item, pytest.Function) else ""


def _family_of(item: pytest.Item) -> registry.Family | None:
    callspec = getattr(item, "callspec", None)
    family = None if callspec is None else callspec.params.get("family")
    return family if isinstance(family, registry.Family) else None


def _golden_of(item: pytest.Item) -> Path | None:
    family = _family_of(item)
    if item.get_closest_marker("golden") is None or family is None:
        return None
    case = item.callspec.id.removeprefix(f"{family.name}-")
    return golden_path(goldens_root(item.config), family.name, check_name(item), case)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Claim goldens, mark known divergences, apply the tier, and group the tests.

    Runs before -k/-m deselection on purpose: every generated test claims its golden,
    so neither a tier nor -k makes another test's golden look unused. The tests kept
    are ordered so that those sharing compiled programs (same family, layout and mesh)
    run together; see :class:`ScopePerGroup`.
    """
    if not active(config):
        return
    tier = config.stash[_TIER]
    config.stash[_COLLECTED] = {f.name for item in items if (f := _family_of(item)) is not None}
    kept, left_out = [], []
    for item in items:
        if (path := _golden_of(item)) is not None:
            config.stash[_CLAIMED].add(path)
        family = _family_of(item)
        if family is None:
            kept.append(item)
            continue
        item.user_properties.append(("conformance", (family.name, check_name(item))))
        skipped = item.get_closest_marker("skip") is not None
        if not skipped and (reason := capability_skip(family, item)) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif (reason := known_divergence(family, item)) is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
        (left_out if tier_leaves_out(tier, family, item) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    families = {f.name: i for i, f in enumerate(config.stash[_FAMILIES])}
    meshes = {m.id: i for i, m in enumerate(config.stash[_MESHES]["mesh"])}

    def rank(item: pytest.Item) -> tuple[Any, ...]:
        group = group_of(item)
        if group is None:
            return (-1,)
        family, scan, mesh = group
        return (families.get(family, len(families)), scan, meshes.get(mesh, len(meshes)))

    items[:] = sorted(kept, key=rank)


def tier_leaves_out(tier: Tier, family: registry.Family, item: pytest.Item) -> str:
    """Why ``tier`` leaves ``item`` out (``""`` if it runs it)."""
    if not tier.expected_failures and item.get_closest_marker("xfail") is not None:
        return "expected to fail"
    params = item.callspec.params
    dtype_ids = {v: k for k, v in DTYPES.items()}
    return tier.leaves_out(family, params, dtype_ids.get(params.get("dtype"), ""))


Group = tuple[str, bool, str]
"""``(family, scan_layers, mesh id)``: tests that can share compiled programs."""


def group_of(item: pytest.Item | None) -> Group | None:
    """The group of a suite test; ``None`` for anything else.

    A test without a layout parameter joins the family's preferred layout; one without
    a mesh parameter (it uses ``primary_mesh``, or none) joins the primary mesh.
    """
    family = _family_of(item) if item is not None else None
    if family is None:
        return None
    params = item.callspec.params
    scan = params.get("scan_layers")
    if scan is None:
        scan = family.capabilities.preferred_scan_layers
    mesh = params.get("mesh")
    if not isinstance(mesh, MeshSpec):
        mesh = run_meshes(item.config)[0]
    return (family.name, bool(scan), mesh.id)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop with a usage error if the selection removed every test of a chosen family."""
    config = session.config
    if not active(config):
        return
    chosen = {f.name for f in config.stash[_FAMILIES]}
    collected = config.stash.get(_COLLECTED, set())
    running = {f.name for item in session.items if (f := _family_of(item)) is not None}
    emptied = sorted((collected & chosen) - running)
    if emptied:
        how = f"tier {config.stash[_TIER].name!r}"
        for flag, option in (("-k", "keyword"), ("-m", "markexpr")):
            if value := config.getoption(option):
                how += f" and {flag} {value!r}"
        pytest.exit(
            f"the selection ({how}) removed every test of {', '.join(emptied)}; "
            "widen it or narrow --conformance-family",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def known_divergence(family: registry.Family, item: pytest.Item) -> str | None:
    """The reason ``family`` declares ``item``'s check a known divergence, if it does."""
    check, case = check_name(item), item.callspec.id
    for key, reason in family.known_divergences.items():
        name, _, fragment = key.partition("[")
        if name == check and fragment.removesuffix("]") in case:
            return f"{family.name} known divergence: {reason}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Show a :class:`CheckFailure` as its report alone: the message is the product."""
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(CheckFailure):
        report.longrepr = str(call.excinfo.value)
    return report


class Golden:
    """The golden file of one test: fails clearly when missing or corrupt, else matches.

    In a multi-controller run that regenerates goldens, process 0 writes them and the
    other processes (``written_elsewhere``) compare nothing.
    """

    def __init__(
        self, snapshot: Any, root: Path, path: Path, update: bool, written_elsewhere: bool = False
    ) -> None:
        self._snapshot = snapshot.use_extension(GoldenExtension.for_root(root))
        self.root, self.path, self.update = root, path, update
        self.written_elsewhere = written_elsewhere

    def check(self, data: Any) -> None:
        """Assert that ``data``, normalised, equals the golden (or write it when updating)."""
        if self.written_elsewhere:
            return
        if not self.update:
            try:
                load(self.path)
            except GoldenError as err:
                family, check = self.path.parent.parent.name, self.path.parent.name
                pytest.fail(
                    f"{err}\n  regenerate with: python -m conformance --family {family} -m golden "
                    f'--snapshot-update --tier full -k "{check} and {self.path.stem}" and '
                    "review the diff before committing",
                    pytrace=False,
                )
        index = self.path.relative_to(self.root).with_suffix("").as_posix()
        assert self._snapshot(name=index) == data


@pytest.fixture
def golden(request: pytest.FixtureRequest, snapshot: Any) -> Golden:
    """The :class:`Golden` of the requesting test (which must be marked ``golden``)."""
    path = _golden_of(request.node)
    if path is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses `golden` without @pytest.mark.golden")
    update = bool(request.config.option.update_snapshots)
    elsewhere = update and not distributed.is_leader()
    return Golden(snapshot, goldens_root(request.config), path, update, elsewhere)


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh directory for the test that every process of the run reads and writes.

    With one process it is ``tmp_path``. In a multi-controller run it lies under
    ``--conformance-shared-dir`` (the test skips, saying so, without one), named after
    the test, emptied by process 0 before any process uses it.
    """
    if not distributed.is_multiprocess():
        return tmp_path
    root = _option(request.config, "shared_dir")
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


def _devices_or_skip(mesh: MeshSpec) -> Any:
    try:
        return mesh.devices()
    except InsufficientDevices as err:
        pytest.skip(str(err))


@pytest.fixture
def tier(request: pytest.FixtureRequest) -> Tier:
    """The run's :class:`~conformance.tiers.Tier` (``--tier``)."""
    return request.config.stash[_TIER]


@pytest.fixture
def device_mesh(mesh: MeshSpec) -> Any:
    """The device mesh for ``mesh``; skips with the reason if there are too few devices."""
    return _devices_or_skip(mesh)


@pytest.fixture
def primary_mesh(request: pytest.FixtureRequest) -> tuple[MeshSpec, Any]:
    """The run's primary mesh and its devices, for checks that need only one mesh."""
    mesh = run_meshes(request.config)[0]
    return mesh, _devices_or_skip(mesh)


class SessionReport:
    """Per-session results: the family x check matrix and the unused-goldens verdict."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.unused: list[Path] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count each suite test's outcome under its (family, check) cell."""
        key = dict(report.user_properties).get("conformance")
        if key is None or (report.when != "call" and report.passed):
            return
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        self.results[tuple(key)][outcome] += 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Fail the session if a golden is unused (never on an xdist worker)."""
        if hasattr(self.config, "workerinput") or session.exitstatus not in (0, 1):
            return
        self.unused = unused_goldens(self.config)
        if self.unused:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Print the agreement matrix (process 0 only) and any unused goldens."""
        if self.results and not distributed.is_leader():
            terminalreporter.write_line("agreement matrix: in process 0's output")
        elif self.results:
            title = "Linen/NNX agreement (agreed/run; f=failed s=skipped x=xfailed)"
            terminalreporter.section(title)
            for line in agreement_matrix(self.results):
                terminalreporter.write_line(line)
        if self.unused:
            terminalreporter.section("unused goldens", red=True)
            terminalreporter.write_line(
                "no collected test claims these files; if their tests were removed or renamed "
                "on purpose, delete them with `git rm` in a reviewed commit:"
            )
            for path in self.unused:
                terminalreporter.write_line(f"  {path.relative_to(self.config.rootpath)}")


def unused_goldens(config: pytest.Config) -> list[Path]:
    """Golden files no collected test claims, within what this run could claim.

    A run narrowed by node id or by ``--mesh``/``--topology`` checks nothing (it cannot
    know what the rest of the suite claims); a run narrowed by ``--family`` checks only
    those families; ``-k``/``-m`` do not narrow (claims are taken before deselection).
    """
    narrowed = any("::" in arg for arg in config.args)
    if narrowed or _option(config, "mesh") or _option(config, "topology"):
        return []
    claimed = config.stash[_CLAIMED]
    checks = {(p.parent.parent.name, p.parent.name) for p in claimed}
    root = goldens_root(config)
    on_disk = {p for fam, check in checks for p in (root / fam / check).glob(f"*{SUFFIX}")}
    if not _option(config, "family") and claimed:
        known = {f.name for f in config.stash[_FAMILIES]}
        on_disk |= {p for p in root.glob(f"*/*/*{SUFFIX}") if p.parent.parent.name not in known}
    return sorted(on_disk - claimed)


def agreement_matrix(results: dict[tuple[str, str], dict[str, int]]) -> list[str]:
    """The family x check table, one row per family; a cell reads ``agreed/run (extras)``."""
    rows = matrix_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]


class ScopePerGroup:
    """Releases compiled programs when the next test belongs to another group, or sooner.

    Tests of one :data:`Group` run together (see ``pytest_collection_modifyitems``) and
    share runners, trainers and their executables through the active
    :class:`~conformance.core.scope.Scope`; when the group changes, the scope is released, so
    a run's memory mappings and RSS stay bounded by one group's programs however many
    families, meshes and layouts it covers. A group whose programs alone pass half of
    the kernel's mapping limit (``vm.max_map_count``) is released early, between two of
    its tests: its later tests recompile what they share, and the run does not crash.
    Host results (:func:`~conformance.core.scope.kept`, such as one-device references) stay
    while the family and layout stay, so each is computed once per family and layout.
    """

    def __init__(self) -> None:
        limit = scope.mapping_limit()
        self.budget = None if limit is None else limit // 2
        self.releases = 0
        self.early = 0
        self.peak = 0

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        """After a test's teardown, release the scope at a group boundary or over budget."""
        try:
            return (yield)
        finally:
            group = group_of(item)
            mappings = scope.mapping_count() or 0
            self.peak = max(self.peak, mappings)
            following = group_of(nextitem)
            if group is not None and group != following:
                self.releases += 1
                same_layout = following is not None and following[:2] == group[:2]
                scope.release(keep_results=same_layout)
            elif self.budget is not None and mappings > self.budget:
                self.early += 1
                scope.release(keep_results=True)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """How often programs were released and the peak memory-mapping count seen."""
        if self.releases or self.early:
            limit = scope.mapping_limit()
            terminalreporter.write_line(
                f"compiled programs released {self.releases} time(s) between test groups and "
                f"{self.early} time(s) early; peak memory mappings {self.peak} "
                f"(limit {limit})"
            )
