"""How a check declares itself: the decorator on its function, and the entry it makes.

A check is a function of a :class:`~conformance.runtime.case.Case` (and its own
parameters) in an area module of :mod:`conformance.checks`. :func:`declare` on that
function is the whole of its registration: its axes, parameters, what a family needs for
it, its goldens and its known library failures sit above its body. The registry collects
every declared check of the area modules (:func:`declared`); a zoo names a declared
function (or a :class:`Check`) in an entry point.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Literal, TypeVar

from conformance.checks import raised
from conformance.contract import Family
from conformance.core.failure import CheckFailure, KnownFailure, checking, fail
from conformance.runtime.case import Case
from conformance.runtime.sides import SIDES


class Axis(enum.StrEnum):
    """An axis a test can be parametrized over; it compares equal to its fixture name."""

    FAMILY = "family"
    SIZE = "size"
    FULL_SIZE = "full_size"
    MESH = "mesh"
    TOPOLOGY = "topology"
    TPU = "tpu"
    SCAN_LAYERS = "scan_layers"
    DTYPE = "dtype"
    QUANT = "quant"
    RECORDED = "recorded"
    PAIR = "pair"


AXES: tuple[Axis, ...] = tuple(Axis)
"""The axes a test can be parametrized over, in test-id order."""

Where = Literal["each", "primary", "topology", "tpu", "none"]
"""Where a check runs: on each device mesh of the run, on the run's primary mesh, on
each abstract production topology, on each TPU slice it compiles for (``--tpu``: a
mesh of the slice's devices, described by libtpu), or on no mesh."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One value of a check's own parameter: its test id, its value, what it needs."""

    id: str
    value: Any
    capability: str | None = None
    """A :class:`~conformance.contract.Capabilities` field this value needs."""
    layouts: tuple[bool, ...] = ()
    """Layer layouts (``True``: scanned) this value needs."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: how it is parametrized, what it needs, and the function that runs it."""

    name: str
    run: Callable[..., Any] | None
    """``run(case, **params)``, returning a golden payload (or ``None``); ``None`` for a
    test that is not a registered check (a user's own test over the plugin's axes)."""
    axes: tuple[str, ...]
    """Case axes the check is parametrized over, a subset of :data:`AXES` in its order."""
    params: tuple[tuple[str, tuple[Param, ...]], ...] = ()
    """The check's own parameters, ``(name, values)`` in test-id order after the axes."""
    where: Where = "each"
    devices: bool = True
    """Whether the check places arrays on the mesh (it skips when the mesh is too large)."""
    capability: str | None = None
    """A :class:`~conformance.contract.Capabilities` field every family must declare."""
    layouts: tuple[bool, ...] = ()
    """Layer layouts every family must support."""
    variant: bool = False
    """The check compares a variant of the step or forward that ``train_step`` and
    ``forward`` compare on every mesh (quantized, in lower precision, accumulated over
    micro-batches, with a tiled loss), partitioned as the plain programs are: the
    ``default`` tier runs it on the primary mesh in the family's preferred layer layout
    only (``full`` on every mesh, in every layout), and its
    tests carry the ``variant`` marker, so a run can leave them out (``-m "not variant"``)."""
    mode_pair: bool = False
    """The check compares two modes of the NNX model (graph against tree mode, auto
    against explicit axes) rather than two backends: the ``default`` tier runs it in the
    family's preferred layer layout only, as ``smoke`` does (``full`` in every layout)."""
    costly_pairs: bool = False
    """Its mode-pair tests (two modes of the NNX model on the ``pair`` axis) compile
    programs of their own beyond those ``forward``, ``train_step`` and ``decode`` compile
    for the pair (probed, cost-analysed, resumed from a checkpoint): the ``smoke`` tier
    leaves them out, for time, and ``default`` runs them."""
    costly_production: bool = False
    """At a production size on a TPU slice (``--tpu ...@production``) it compiles each
    side's programs once more beyond ``tpu_compile``'s (with probes): the ``smoke`` tier
    leaves those tests out, for time, and ``default`` runs them."""
    quant_method: str | None = None
    """Parametrize ``quant`` only over modes of this method (``qat``, ``ptq``)."""
    golden: bool = False
    """The check returns a payload compared with its golden file."""
    golden_by_platform: bool = False
    """Its golden depends on the platform and XLA optimisation level it was computed at,
    and on the mesh (compiled cost): one golden per ``<platform>-xla-<level>`` folder,
    named after the mesh, so a TPU runner and a laptop CPU mesh keep theirs apart."""
    workdir: bool = False
    """The check writes files: it is given a directory every process can share."""
    saved_on: bool = False
    """The check is also given its case on the run's primary mesh (``saved_on``)."""
    pair: bool = True
    """The check compares a live Linen side with a live NNX side: a family without Linen
    skips it (a check parametrized by ``backend`` skips only its Linen tests; one
    parametrized by ``pair``, only its Linen-vs-NNX tests)."""
    references: bool = False
    """The check compares with a recorded reference: it is given the recorded backend
    (``recorded``, an axis) and the directory references live in (``references``)."""
    known_failure: Callable[[Mapping[str, Any]], KnownFailure | str | None] | None = None
    """Why a case fails with the pinned libraries (a strict xfail), by its axis values: a
    :class:`~conformance.core.failure.KnownFailure` holds the words its report must show,
    a reason alone lets any check failure stand for it."""
    requires: Callable[[Family], str | None] | None = None
    """Why a family cannot run this check beyond its capabilities (a skip reason)."""
    given: tuple[str, ...] = ()
    """Axes whose values the check is also given, as keyword arguments of those names."""
    suite: str = ""
    """The suite module its test is collected from, ``conformance.suite.test_<suite>``;
    default: its area's (see :attr:`suite_module`)."""

    def __call__(self, case: Case, **params: Any) -> Any:
        """Run the check on ``case``; its failures are headed ``<family> <check>:``.

        An exception raised inside one of the case's sides is a failure too, reported by
        :func:`conformance.checks.raised.report` (the original stays its context); any
        other exception propagates unchanged.
        """
        if self.run is None:
            raise TypeError(f"{self.name} is not a registered check")
        with checking(case.family.name, self.name):
            try:
                return self.run(case, **params)
            except CheckFailure:
                raise
            except Exception as err:
                message = raised.report(case, err)
                if message is None:
                    raise
                fail(message)

    @property
    def area(self) -> str:
        """Its area: its module in :mod:`conformance.checks` (``training``, ``decode``, ...).

        ``zoo`` for a check a zoo registers, ``user`` for a user's own test.
        """
        if self.run is None:
            return "user"
        if self.suite == ZOO_SUITE:
            return ZOO_SUITE
        return self.run.__module__.rsplit(".", 1)[-1]

    @property
    def suite_module(self) -> str:
        """The name of the suite module its test is collected from (``test_decode``)."""
        return "test_" + (self.suite or _AREA_SUITES.get(self.area, self.area))


ZOO_SUITE = "zoo"
"""The suite (and area) of every check a zoo registers: ``conformance.suite.test_zoo``."""

_AREA_SUITES = {"training": "train_step", "invariance": "sharding_invariance"}
"""The suite module of an area whose name differs from its module of checks."""


F = TypeVar("F", bound=Callable[..., Any])

_DECLARED = "__conformance_checks__"
"""The attribute :func:`declare` keeps a function's checks in, in source order."""


def declare(
    axes: tuple[Axis, ...],
    params: tuple[tuple[str, tuple[Param, ...]], ...] = (),
    *,
    name: str | None = None,
    **fields: Any,
) -> Callable[[F], F]:
    """Declare the decorated function a check, with ``axes``, ``params`` and ``fields``.

    ``fields`` are :class:`Check`'s (``where``, ``capability``, ``golden``, ...). The check
    is named ``name``, by default the function's name without ``check_``. The function is
    returned unchanged; stacked, the decorators declare one check each, in source order.
    """

    def decorate(run: F) -> F:
        found = Check(name or run.__name__.removeprefix("check_"), run, axes, params, **fields)
        setattr(run, _DECLARED, (found, *getattr(run, _DECLARED, ())))
        return run

    return decorate


def checks_of(obj: object) -> tuple[Check, ...]:
    """The checks ``obj`` declares: itself if it is a :class:`Check`, else its decorations."""
    if isinstance(obj, Check):
        return (obj,)
    return getattr(obj, _DECLARED, ())


def declared(module: ModuleType) -> tuple[Check, ...]:
    """The checks declared on ``module``'s own functions, in source order."""
    return tuple(
        found
        for obj in vars(module).values()
        if getattr(obj, "__module__", None) == module.__name__
        for found in getattr(obj, _DECLARED, ())
    )


_MESH_AXIS = {"each": Axis.MESH, "topology": Axis.TOPOLOGY, "tpu": Axis.TPU}
"""The axis a check's ``where`` takes its mesh from."""


def unfit(check: Check) -> str | None:
    """Why ``check`` cannot be parametrized as declared, in one line, or ``None``.

    Built-in checks and a zoo's are held to the same rules: known axes, each once in
    test-id order, starting with ``family``; the axis its ``where`` needs; ``given`` axes
    among its axes; no parameter named like an axis.
    """
    if check.run is None:
        return "the check has no function to run"
    axes = list(check.axes)
    if unknown := [axis for axis in axes if axis not in AXES]:
        return f"unknown axes {unknown}; axes are {', '.join(AXES)}"
    if axes != sorted(set(axes), key=AXES.index):
        return (
            f"axes {[str(a) for a in axes]} are not each once in test-id order ({', '.join(AXES)})"
        )
    if axes[:1] != [Axis.FAMILY]:
        return "its axes must start with 'family'"
    if (axis := _MESH_AXIS.get(check.where)) and axis not in axes:
        return f"a check run where={check.where!r} needs the axis {str(axis)!r}"
    if check.references and Axis.RECORDED not in axes:
        return "a check of recorded references needs the axis 'recorded'"
    if extra := [str(axis) for axis in check.given if axis not in axes]:
        return f"given axes {extra} are not among its axes"
    if clash := [name for name, _ in check.params if name in AXES]:
        return f"parameters {clash} are named like axes"
    return None


ON_MESH = (Axis.FAMILY, Axis.MESH, Axis.SCAN_LAYERS)
"""The axes of a check run on each mesh, on each layer layout."""

SIDE_VALUES = tuple(Param(backend, backend) for backend in SIDES)
"""One value per backend: a check's ``backend`` parameter."""

BACKENDS = (("backend", SIDE_VALUES),)
"""The ``backend`` parameter of a check that tests each live backend alone."""
