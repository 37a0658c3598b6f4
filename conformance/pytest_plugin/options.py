"""The plugin's options, in one table: pytest's flags, the conformance-run test, the short forms.

Every option is ``--conformance-<name>`` on pytest's command line, so none can clash
with a host project's own; ``python -m conformance`` also takes it as ``--<name>``.
This module imports nothing heavy: pytest loads it in every run where the package is
installed, conformance run or not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from conformance.core.environment import XLA_OPT_LEVELS
from conformance.pytest_plugin.tiers import DEFAULT_TIER, TIERS

PREFIX = "--conformance-"

DEFAULT_MESHES = ("data=2,fsdp=2,tensor=2", "fsdp=8")
DEFAULT_TOPOLOGIES = ("4x4x4", "4x8x8")
DEFAULT_TPU = ("v6e:2x4", "v5p:4x4x4@production")
"""The TPU targets ``--tpu default`` names: a small slice at the device size, a large one
at the production sizes (the tier decides which run)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One ``--conformance-<name>`` option (``name`` with dashes; its value is ``dest``)."""

    name: str
    help: str | None = None
    default: Any = None
    action: str | None = None
    type: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    selects: bool = True
    """Giving it makes a pytest run a conformance run (see :func:`selects_suite`)."""

    @property
    def flag(self) -> str:
        """``--conformance-<name>``."""
        return PREFIX + self.name

    @property
    def short(self) -> str:
        """``--<name>``, as ``python -m conformance`` takes it."""
        return "--" + self.name

    @property
    def dest(self) -> str:
        """The attribute pytest stores the value in: ``conformance_<name>`` with underscores."""
        return "conformance_" + self.name.replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    Option(
        "family",
        "run only this family, or the families a glob such as 'maxtext-*' matches "
        "(repeatable); default: every registered family",
        default=[],
        action="append",
        metavar="NAME",
    ),
    Option(
        "mesh",
        f"device mesh to run on (repeatable); default: {' and '.join(DEFAULT_MESHES)}",
        default=[],
        action="append",
        metavar="SPEC",
    ),
    Option(
        "topology",
        "abstract production mesh for full-size sharding goldens (repeatable); "
        f"default: {' and '.join(DEFAULT_TOPOLOGIES)}",
        default=[],
        action="append",
        metavar="SPEC",
    ),
    Option(
        "tpu",
        "compile both sides for this TPU slice on this host, without a TPU, and compare "
        "what libtpu makes of them (repeatable): GEN:AxB[xC] (e.g. v6e:2x4) compiles the "
        "device size, GEN:AxB[xC]@production each production size; '=MESH' after it "
        "picks the mesh over its chips; 'default' names "
        f"{' and '.join(DEFAULT_TPU)}. Needs libtpu (make setup-tpu)",
        default=[],
        action="append",
        metavar="TARGET",
    ),
    Option(
        "tier",
        "how much of the suite to run: "
        + "; ".join(f"{t.name}: {t.summary}" for t in TIERS.values())
        + f" (default: {DEFAULT_TIER})",
        default=DEFAULT_TIER,
        metavar="NAME",
    ),
    Option(
        "xla-opt",
        "XLA optimisation level: low (most passes off, compiles several times faster; "
        "the default) or full (as production code compiles, for a nightly job)",
        default="low",
        choices=XLA_OPT_LEVELS,
    ),
    Option(
        "report",
        "write report.json, report.md, report.html (with divergence plots) and "
        "junit.xml to DIR, merged with the reports of other processes writing there",
        metavar="DIR",
    ),
    Option(
        "progress",
        "print one line per family x check as it runs instead of a character per test",
        default=False,
        action="store_true",
    ),
    Option(
        "distributed",
        "join a multi-controller run (one process per host) that JAX detects itself, "
        "as on a TPU pod slice: run the same command on every host",
        default=False,
        action="store_true",
    ),
    Option(
        "coordinator",
        "join a multi-controller run whose process 0 serves at HOST:PORT (with "
        "--conformance-num-processes and --conformance-process-id)",
        metavar="HOST:PORT",
    ),
    Option(
        "num-processes",
        "how many processes the run has (with --conformance-coordinator)",
        type=int,
        metavar="N",
        selects=False,
    ),
    Option(
        "process-id",
        "this process's index, 0 to N-1 (with --conformance-coordinator)",
        type=int,
        metavar="I",
        selects=False,
    ),
    Option(
        "connect-timeout",
        "how long a process waits for the coordinator and the others (default: 300)",
        default=300,
        type=int,
        metavar="SECONDS",
        selects=False,
    ),
    Option(
        "shared-dir",
        "a directory every process of a multi-controller run can read and write, for "
        "checkpoints (their tests skip without one); default: pytest's tmp_path",
        metavar="DIR",
    ),
)
"""Every option of the plugin, in ``--help`` order."""

INI = (
    ("conformance_goldens", "directory of golden files", None, "goldens"),
    (
        "conformance_builtin_families",
        "run the families this package ships (gpt3, llama, moe, maxtext-*) when no "
        "--conformance-family is given",
        "bool",
        True,
    ),
)
"""The plugin's ini options: ``(name, help, type, default)``."""


def add_options(parser: pytest.Parser) -> None:
    """Declare every option of :data:`OPTIONS` and :data:`INI` on pytest's ``parser``."""
    group = parser.getgroup("conformance", "Linen/NNX conformance")
    for option in OPTIONS:
        kwargs = {
            key: value
            for key, value in dataclasses.asdict(option).items()
            if key in ("help", "action", "type", "metavar", "choices") and value is not None
        }
        group.addoption(option.flag, dest=option.dest, default=option.default, **kwargs)
    for name, help_, type_, default in INI:
        parser.addini(name, help_, type=type_, default=default)


def value(config: pytest.Config, name: str) -> Any:
    """The value of the option called ``name`` (``"xla-opt"``, ``"family"``, ...)."""
    return config.getoption("conformance_" + name.replace("-", "_"))


def expand(argv: Sequence[str]) -> list[str]:
    """``argv`` with each short option prefixed and joined to its value.

    ``--tier smoke`` and ``--tier=smoke`` both become ``--conformance-tier=smoke``. Joined,
    a value that is an existing path (``--report DIR``) is never taken by pytest for a
    test path, which would move the rootdir and configuration file it finds.
    """
    flags = {option.short: option.flag for option in OPTIONS}
    flags |= {option.flag: option.flag for option in OPTIONS}
    valued = {option.flag for option in OPTIONS if option.action != "store_true"}
    expanded, rest = [], iter(argv)
    for arg in rest:
        name, eq, value = arg.partition("=")
        flag = flags.get(name)
        if flag in valued and not eq and (following := next(rest, None)) is not None:
            joined = not following.startswith("-")  # else argparse says the value is missing
            expanded += [f"{flag}={following}"] if joined else [flag, following]
        elif flag is not None:
            expanded.append(f"{flag}{eq}{value}")
        else:
            expanded.append(arg)
    return expanded


def selects_suite(config: pytest.Config) -> bool:
    """Whether this run is a conformance run: the plugin acts only then.

    It is when a selecting option is given (any but the multi-controller process
    numbering), when an argument (a path, or a module with ``--pyargs``) lies inside
    ``conformance.suite``, or when the run is in a source checkout of this project (its
    rootdir holds the suite, not installed). Any other pytest run in an environment
    with this package installed is left alone: no XLA flags, no devices, no
    parametrization, no report, and nothing heavier than pytest imported.
    """
    if any(value(config, o.name) != o.default for o in OPTIONS if o.selects):
        return True
    spec = importlib.util.find_spec("conformance.suite")
    suite = Path(spec.origin).parent
    installed = "site-packages" in suite.parts
    if not installed and config.rootpath in suite.parents:
        return True
    for arg in config.args:
        path = _arg_path(config, arg.split("::")[0])
        if path is not None and (path == suite or suite in path.parents):
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
        else config.invocation_params.dir
    )
    return (base / arg).resolve()
