"""A check's registry entry: how it is parametrized, what it needs, how it is called."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from conformance.checks import raised
from conformance.contract import Family
from conformance.core.failure import CheckFailure, checking, fail
from conformance.runtime.case import Case

AXES = (
    "family",
    "size",
    "full_size",
    "mesh",
    "topology",
    "tpu",
    "scan_layers",
    "dtype",
    "quant",
    "recorded",
)
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
    skips it (a check parametrized by ``backend`` skips only its Linen tests)."""
    references: bool = False
    """The check compares with a recorded reference: it is given the recorded backend
    (``recorded``, an axis) and the directory references live in (``references``)."""
    known_failure: Callable[[Mapping[str, Any]], str | None] | None = None
    """Why a case fails with the pinned libraries (a strict xfail), by its axis values."""
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


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """Why a test is expected to fail: a strict xfail, optionally of one exception type."""

    reason: str
    raises: type[BaseException] | None = None


def expected_failure(
    check: Check, family: Family, values: Mapping[str, Any], case_id: str
) -> ExpectedFailure | None:
    """Why ``check`` fails on this case: a known library failure or a family's divergence.

    A known library failure must fail as a check failure; a divergence a family declares
    (``Family.known_divergences``, keyed ``check`` or ``check[id fragment]``) may fail
    any way, since it is the family's finding.
    """
    if check.known_failure is not None and (reason := check.known_failure(values)):
        return ExpectedFailure(reason, CheckFailure)
    for key, reason in family.known_divergences.items():
        name, _, fragment = key.partition("[")
        if name == check.name and fragment.removesuffix("]") in case_id:
            return ExpectedFailure(f"{family.name} known divergence: {reason}")
    return None
