"""A conformance run's settings, and setting the run up once the plugin knows it is one.

:func:`configure` runs from ``pytest_configure`` of a conformance run only: it prepares
the devices (before any backend starts), joins a multi-controller run when asked,
and chooses the families, meshes and tier. The settings are one value
(:class:`Settings`) kept on the config; the other modules read them with
:func:`settings`. The plugin's working parts (:mod:`~conformance.pytest_plugin.parts`)
import this module, never the other way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import pytest

from conformance import contract
from conformance.contract import Family, Pair, preferred_layout, recorded_backends, supports
from conformance.core import distributed, programs
from conformance.core.environment import (
    configure_host_platform,
    nnx_mode,
    set_matmul_precision,
    set_xla_opt,
)
from conformance.core.references import references_root
from conformance.core.roots import Goldens, GoldensError, installed, project_goldens
from conformance.core.sharding import MeshSpec, MeshSpecError, parse_mesh
from conformance.core.tpu import (
    NOISE,
    TopologyError,
    TpuTarget,
    libtpu_version,
    production_target,
    slice_devices,
)
from conformance.pytest_plugin import options, workers
from conformance.pytest_plugin.tiers import Tier
from conformance.runtime.provenance import Built
from conformance.runtime.recorded import MissingReference, load
from conformance.runtime.sides import SIDES

DTYPES = {"f32": jax.numpy.float32, "bf16": jax.numpy.bfloat16}
LAYOUTS = {"loop": False, "scan": True}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a conformance run covers, decided once from its options."""

    families: tuple[Family, ...]
    meshes: tuple[MeshSpec, ...]
    """The configured device meshes (``--mesh``, or the defaults)."""
    topologies: tuple[MeshSpec, ...]
    tier: Tier
    xla_opt: str
    goldens: Goldens
    """Where each family's goldens and recorded references live."""
    tpu: tuple[TpuTarget, ...] = ()
    """The TPU slices both sides are compiled for (``--tpu``); none by default."""
    placed: Mapping[str, Mapping[TpuTarget, Mapping[str, TpuTarget]]] = dataclasses.field(
        default_factory=dict
    )
    """Family -> ``--tpu default``'s production target -> production size -> the slice
    the size compiles for instead (the family's ``Topologies``)."""

    @property
    def run_meshes(self) -> list[MeshSpec]:
        """The device meshes the tier keeps, the primary one first."""
        return self.tier.mesh_order(self.meshes) or list(self.meshes)

    @property
    def primary(self) -> MeshSpec:
        """The mesh checks that need only one mesh run on."""
        return self.run_meshes[0]

    @property
    def platform(self) -> str:
        """``<platform>-xla-<level>``: what a platform-dependent golden is kept under."""
        return f"{jax.devices()[0].platform}-xla-{self.xla_opt}"

    @property
    def tpu_platform(self) -> str:
        """``libtpu-<version>-xla-full``: what a golden compiled for a TPU slice is kept under."""
        return f"libtpu-{libtpu_version()}-xla-full"

    def pairs(self) -> list[str]:
        """What each pair of sides compares, and for which families of the run."""
        found = [f"{Pair.LINEN_NNX.label} (test ids name no pair)"]
        for pair in Pair:
            if pair.capability is None:
                continue
            able = [f.name for f in self.families if supports(f, pair.capability)]
            found.append(f"{pair.id}: {pair.label} ({', '.join(able) or 'no family'})")
        return found

    def header(self) -> list[str]:
        """Lines saying what the run covers: tier, meshes, families, devices, references."""
        tier = self.tier
        kept = [f"meshes {', '.join(m.id for m in self.run_meshes)}", *tier.narrowing(DTYPES)]
        families = ", ".join(f.name for f in self.families) or "none"
        lines = [
            f"conformance: tier {tier.name} ({tier.summary}): " + "; ".join(kept),
            f"conformance: families {families}; XLA optimisation {self.xla_opt}; "
            f"matmul precision {jax.config.jax_default_matmul_precision}; {nnx_mode()}; "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s)",
        ]
        if self.tpu:
            lines.append(
                f"conformance: TPU compiles (libtpu {libtpu_version()}, XLA defaults, nothing "
                f"runs): {'; '.join(map(str, self.tpu))}"
                + "".join(
                    dict.fromkeys(
                        f"; {family} {size} on {target.spec}"
                        for family, by_target in self.placed.items()
                        for sizes in by_target.values()
                        for size, target in sizes.items()
                    )
                )
                + (f"; libtpu start-up wrote {len(NOISE)} line(s), held back" if NOISE else "")
            )
        if recorded := self.recorded():
            lines.append("conformance: recorded_* checks compare " + "; ".join(recorded))
        lines.append("conformance: pairs compared: " + "; ".join(self.pairs()))
        for family, built in self.built.items():
            sides = (
                built
                if isinstance(built, str)
                else "; ".join(f"{side} {b.describe()}" for side, b in built.items())
            )
            lines.append(f"conformance: {family}: {sides}")
        if sown := self.sown:
            listed = "; ".join(
                f"{family} "
                + (", ".join(f"{side} {', '.join(n)}" for side, n in by.items() if n) or "none")
                for family, by in sown.items()
            )
            lines.append(
                f"conformance: sown in a training forward, undeclared (not checked): {listed}"
            )
        lines += [
            f"conformance: {family}: {side} is bridged: parity tests the "
            f"{self.built[family][side].whole} bridge around the other backend's model"
            for family, sides in self.bridged().items()
            for side in sides
        ]
        return lines

    def bridged(self) -> dict[str, list[str]]:
        """Each family's sides that are the other backend's model behind a bridge, by name."""
        return {
            family: whole
            for family, built in self.built.items()
            if not isinstance(built, str)
            and (whole := [side for side, b in built.items() if b.whole])
        }

    @property
    def built(self) -> dict[str, dict[str, Built] | str]:
        """What each side of each family builds: model class and bridged modules.

        ``{family: {"Linen": Built, "NNX": Built}}`` for the base config; a family that
        cannot run here, or whose model fails to build, says why instead (the checks
        report the failure).
        """
        return {
            name: found if isinstance(found, str) else found[0]
            for name, found in self._survey.items()
        }

    @property
    def sown(self) -> dict[str, dict[str, list[str]]]:
        """What each side of each family sows in training and does not declare, by side.

        ``{family: {"Linen": [...], "NNX": [...]}}`` for the base config
        (:func:`~conformance.runtime.sown.undeclared`); a family not built is left out.
        """
        return {
            name: found[1] for name, found in self._survey.items() if not isinstance(found, str)
        }

    @functools.cached_property
    def _survey(self) -> dict[str, tuple[dict[str, Built], dict[str, list[str]]] | str]:
        """Per family, :attr:`built` and :attr:`sown` from one build of each side, or why not."""
        from conformance.core.scope import Scope
        from conformance.runtime.backends import linen_runner, nnx_runner
        from conformance.runtime.sown import undeclared

        found: dict[str, tuple[dict[str, Built], dict[str, list[str]]] | str] = {}
        for family in self.families:
            if (why := family.unavailable()) is not None:
                found[family.name] = f"not built ({why})"
                continue
            scan = preferred_layout(family)
            runners = {"NNX": nnx_runner}
            if family.has_linen:
                runners = {"Linen": linen_runner, **runners}
            try:
                config = family.config(family.device_size, scan_layers=scan)
                with Scope():
                    built = {n: r(family, config).built for n, r in runners.items()}
                    try:
                        sown = undeclared(family, config)
                    except Exception as err:  # the header says so; the checks report it
                        sown = {"training forward": [f"not traced ({type(err).__name__}: {err})"]}
                    found[family.name] = (built, sown)
            except Exception as err:  # a header line, not a verdict: the checks report it
                found[family.name] = f"not built ({type(err).__name__}: {err})"
        return found

    def recorded(self) -> list[str]:
        """``gpt3: Linen and NNX vs recorded Linen (flax ..., jax ...)`` per reference.

        A reference recorded with other library versions lists them: it is compared
        within the tolerance policy all the same.
        """
        live = " and ".join(side.name for side in SIDES.values())
        found = []
        for family in self.families:
            for backend in recorded_backends(family):
                try:
                    reference = load(family, backend, references_root(self.goldens.of(family)))
                except MissingReference:
                    label = f"recorded {SIDES[backend].name} (missing)"
                else:
                    label = reference.label
                    if changes := reference.version_changes():
                        label += f" [versions differ: {', '.join(changes)}]"
                found.append(f"{family.name}: {live} vs {label}")
        return found


_SETTINGS = pytest.StashKey[Settings]()


def settings(config: pytest.Config) -> Settings:
    """The run's :class:`Settings` (only in a conformance run)."""
    return config.stash[_SETTINGS]


def _cluster(config: pytest.Config) -> distributed.Cluster | None:
    """The multi-controller run the options ask this process to join, if any."""
    coordinator = options.value(config, "coordinator")
    if coordinator is None and not options.value(config, "distributed"):
        return None
    return distributed.Cluster(
        coordinator,
        options.value(config, "num-processes"),
        options.value(config, "process-id"),
        options.value(config, "connect-timeout"),
    )


def _refuse_unavailable(families: list[Family]) -> None:
    """Refuse a family the command line named that cannot run here: it would only skip.

    A run of every registered family skips those that cannot run, each with its reason;
    a run that names them (``--family 'maxtext-*'``) exits with a usage error instead,
    so that nothing passes by skipping everything.
    """
    reasons = [f"{family.name}: {why}" for family in families if (why := family.unavailable())]
    if reasons:
        raise pytest.UsageError(
            "named families cannot run here, and a run of them would only skip: "
            + "; ".join(reasons)
        )


def configure(config: pytest.Config, tier: Tier) -> Settings:
    """Set up a conformance run: devices, processes and settings (returned, and kept).

    A bad family, mesh or cluster is a usage error naming the valid values, and so is
    a family named on the command line that cannot run here.
    """
    configure_host_platform()
    cluster = _cluster(config)
    if cluster is not None and (workers.is_controller(config) or workers.is_worker(config)):
        raise pytest.UsageError(
            "a multi-controller run takes one process per host: drop -n (pytest-xdist workers)"
        )
    if cluster is not None:
        try:
            distributed.initialize(cluster)
        except distributed.DistributedError as err:
            raise pytest.UsageError(str(err)) from None
    xla_opt = options.value(config, "xla-opt")
    set_xla_opt(xla_opt)
    set_matmul_precision()
    programs.install()
    if cluster is not None:
        programs.share_between_processes(cluster.timeout_s)
    meshes = options.value(config, "mesh")
    try:
        builtin = bool(config.getini("conformance_builtin_families"))
        families = contract.select(options.value(config, "family"), include_builtin=builtin)
        configured = [parse_mesh(s) for s in meshes or options.DEFAULT_MESHES]
        topologies = options.value(config, "topology") or options.DEFAULT_TOPOLOGIES
        topology = [parse_mesh(s) for s in topologies]
        tpu, placed = _tpu_targets(options.value(config, "tpu"), families)
    except (contract.FamilyError, MeshSpecError, TopologyError) as err:
        raise pytest.UsageError(str(err)) from None
    if options.value(config, "family"):
        _refuse_unavailable(families)
    if meshes:
        tier = dataclasses.replace(tier, meshes=None)
    try:
        goldens = _goldens(config, families)
    except GoldensError as err:
        raise pytest.UsageError(str(err)) from None
    run = Settings(
        tuple(families), tuple(configured), tuple(topology), tier, xla_opt, goldens, tpu, placed
    )
    config.stash[_SETTINGS] = run
    return run


def _tpu_targets(
    values: list[str], families: list[Family]
) -> tuple[tuple[TpuTarget, ...], dict[str, dict[TpuTarget, dict[str, TpuTarget]]]]:
    """The TPU targets ``--tpu`` names, and the production sizes families place elsewhere.

    ``default`` names :data:`~options.DEFAULT_TPU`, and lets each family move a
    production size from its production slice to one of its own (``Topologies``); any
    other slice named on the command line keeps every size. Each slice is described by
    libtpu here, before any test, so a missing libtpu, a topology it does not know or a
    family's malformed ``Topologies`` is a usage error, never a run of skips.
    """
    names = [n for v in values for n in (options.DEFAULT_TPU if v == "default" else [v])]
    targets = tuple(dict.fromkeys(TpuTarget.parse(name) for name in names))
    placed: dict[str, dict[TpuTarget, dict[str, TpuTarget]]] = {}
    if "default" in values:
        defaults = [t for t in map(TpuTarget.parse, options.DEFAULT_TPU) if t.production]
        for family in families:
            sizes = {}
            for size, text in contract.production_topologies(family).items():
                try:
                    sizes[size] = production_target(text)
                except TopologyError as err:
                    raise TopologyError(f"family {family.name!r}, size {size!r}: {err}") from None
            if sizes:
                placed[family.name] = dict.fromkeys(defaults, sizes)
    own = [t for by_target in placed.values() for s in by_target.values() for t in s.values()]
    for name in dict.fromkeys(target.topology.name for target in (*targets, *own)):
        slice_devices(name)
    return targets, placed


def _goldens(config: pytest.Config, families: list[Family]) -> Goldens:
    """The run's goldens directories, from its configuration file, checked before any test.

    The project's is ``conformance_goldens`` resolved against the directory of the file
    pytest read its configuration from (or, with no file, of the invocation for a ``-o``
    override). Raises :class:`GoldensError` when that configuration was found from an
    option's value, a family needs the project's and there is none, ``--snapshot-update``
    would write into an installed package, or the processes of a run disagree. Every
    process of a multi-controller run compares its verdict with the others' before any
    raises, so that none is left waiting for one that stopped.
    """
    try:
        goldens = _resolved(config, families)
        described, problem = goldens.describe(families), None
    except GoldensError as err:
        described, problem = [f"error: {err}"], err
    if distributed.is_multiprocess() and (found := distributed.differences(described)):
        raise GoldensError(f"the processes resolve goldens differently: {found}")
    if problem is not None:
        raise problem
    if workers.is_worker(config) and (sent := workers.given(config, "goldens")) != described:
        raise GoldensError(
            f"this xdist worker resolves goldens to {described}, its controller to {sent}"
        )
    return goldens


def _resolved(config: pytest.Config, families: list[Family]) -> Goldens:
    """The goldens directories as this process resolves them (see :func:`_goldens`)."""
    _refuse_configuration_from_option_values(config)
    value = config.getini("conformance_goldens")
    overridden = any(o.startswith("conformance_goldens=") for o in config.option.override_ini or ())
    if config.inipath is not None:
        goldens = Goldens(project_goldens(config.inipath.parent, value))
    elif overridden:
        goldens = Goldens(project_goldens(config.invocation_params.dir, value))
    else:
        goldens = Goldens(None)
    roots = {family.name: goldens.of(family) for family in families}
    if config.option.update_snapshots and (
        shipped := [f"{name} ({root})" for name, root in roots.items() if installed(root)]
    ):
        raise GoldensError(
            "--snapshot-update would write into an installed package the goldens it ships: "
            f"{', '.join(shipped)}; regenerate them from a clone of the package's repository"
        )
    return goldens


def _refuse_configuration_from_option_values(config: pytest.Config) -> None:
    """Refuse a run whose configuration file pytest found from an option's value.

    pytest looks for its rootdir and configuration file from the command line's existing
    paths before it knows a plugin's options, so ``--conformance-report DIR`` with an
    existing ``DIR`` counts as a test path. The file it would find from the test paths
    alone is compared with the one it read; they differ only then.
    """
    from _pytest.config.findpaths import determine_setup

    tests = config.args if config.args_source == pytest.Config.ArgsSource.ARGS else []
    _, inipath, _, _ = determine_setup(
        inifile=config.option.inifilename,
        override_ini=config.option.override_ini,
        args=tests,
        rootdir_cmd_arg=config.option.rootdir or None,
        invocation_dir=config.invocation_params.dir,
    )
    if inipath != config.inipath:
        here = config.invocation_params.dir
        taken = [
            a
            for a in map(str, config.invocation_params.args)
            if not a.startswith("-") and a not in tests and (here / a).exists()
        ]
        raise GoldensError(
            f"pytest took {', '.join(taken) or 'an option value'} for a test path and read its "
            f"configuration from {config.inipath or 'no file'} instead of {inipath or 'none'}: "
            "join path options to their values (--conformance-report=DIR)"
        )
