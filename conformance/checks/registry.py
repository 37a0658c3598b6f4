"""Every check of the suite in one table: its name, what it runs on, what it needs.

The table drives the suite: the pytest plugin parametrizes each suite test from its
:class:`Check` (axes, parameters, capability, layouts, quantization method), marks the
expected failures through :func:`expected_failure` (the one mechanism for them), keeps
goldens for the checks that have them and labels the matrix and the reports by check
name. The planted-fault runner calls checks through it too. A check is called with a
:class:`~conformance.runtime.case.Case` and its own parameters, and every failure it
raises is headed ``<family> <check>:``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax.numpy as jnp

from conformance.checks import (
    aqt,
    checkpoint,
    cost,
    decode,
    forward,
    invariance,
    quantization,
    raised,
    recorded,
    state,
    structure,
    tpu,
    training,
)
from conformance.contract import Family
from conformance.core.failure import CheckFailure, checking, fail
from conformance.core.sharding import MeshSpec
from conformance.runtime import aqt as aqt_runtime
from conformance.runtime import quant
from conformance.runtime.case import Case
from conformance.runtime.sides import SIDES

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

        ``user`` for a user's own test.
        """
        return "user" if self.run is None else self.run.__module__.rsplit(".", 1)[-1]

    @property
    def suite_module(self) -> str:
        """The name of the suite module its test is collected from (``test_decode``)."""
        return "test_" + (self.suite or _AREA_SUITES.get(self.area, self.area))


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


def _qwix_known_failure(values: Mapping[str, Any]) -> str | None:
    if values["quant"] is None:  # the family declares no mode: the test skips
        return None
    return quant.known_failure(values["quant"], values["scan_layers"])


def _recorded_qwix_known_failure(values: Mapping[str, Any]) -> str | None:
    """A mode the pinned Qwix computes wrongly in the layout references are recorded in.

    The recorder leaves those logits out (its manifest's ``not_recorded`` says why).
    """
    if values["quant"] is None:
        return None
    scan = values["family"].capabilities.preferred_scan_layers
    return quant.known_failure(values["quant"], scan)


def _aqt_known_failure(values: Mapping[str, Any]) -> str | None:
    return aqt_runtime.known_failure("aqt_layout", values["scan_layers"])


def _declares_topology_mode(family: Family) -> str | None:
    mode = quantization.TOPOLOGY_MODE
    if mode in family.capabilities.quantization:
        return None
    return f"{family.name} does not declare {mode}"


_ON_MESH = ("family", "mesh", "scan_layers")
_SIDE_VALUES = tuple(Param(backend, backend) for backend in SIDES)
_BACKENDS = (("backend", _SIDE_VALUES),)
_LIVE = (("backend", tuple(Param(f"live-{backend}", backend) for backend in SIDES)),)


def _declares_bridges(family: Family) -> str | None:
    """Why ``family`` cannot run ``provenance``: it declares no ``expected_bridges``."""
    if family.expected_bridges is None:
        return f"{family.name} declares no expected_bridges (Family.expected_bridges)"
    return None


def _additive_loss(family: Family) -> str | None:
    """Why micro-batches cannot reproduce ``family``'s whole-batch step, if they cannot.

    Only a family whose own configs sow auxiliary losses (:attr:`Family.sows_aux_losses`).
    """
    if family.sows_aux_losses:
        names = family.capabilities.aux_losses
        return (
            f"{family.name} sows auxiliary losses ({', '.join(names)}) that may be computed "
            "from batch statistics: accumulated over micro-batches they are computed per "
            "micro-batch, so the step need not equal the whole batch's"
        )
    return None


def _against_recorded(
    name: str,
    run: Callable[..., Any],
    axes: tuple[str, ...] = ("family", "recorded"),
    capability: str | None = None,
    known_failure: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> Check:
    """A check of each live backend against a recorded reference, on the primary mesh."""
    return Check(
        name,
        run,
        axes,
        _LIVE,
        where="primary",
        capability=capability,
        pair=False,
        references=True,
        known_failure=known_failure,
    )


_CONVERSIONS = (
    (
        "layouts",
        tuple(
            Param(f"{source}-{target}", (s, t), layouts=(s, t))
            for (source, s), (target, t) in (
                (("loop", False), ("loop", False)),
                (("scan", True), ("scan", True)),
                (("loop", False), ("scan", True)),
                (("scan", True), ("loop", False)),
            )
        ),
    ),
    ("source", _SIDE_VALUES),
)
_LAYOUT_VARIANTS = (
    (
        "variant",
        (
            Param("remat", "remat", capability="remat"),
            Param("scan_layers", "scan_layers", layouts=(True,)),
        ),
    ),
)

CHECKS: dict[str, Check] = {
    check.name: check
    for check in (
        # aqt
        Check("aqt_forward", aqt.check_aqt_forward, _ON_MESH, capability="aqt"),
        Check("aqt_train_step", aqt.check_aqt_train_step, _ON_MESH, capability="aqt"),
        Check(
            "aqt_layout",
            aqt.check_aqt_layout,
            _ON_MESH,
            devices=False,
            capability="aqt",
            golden=True,
            known_failure=_aqt_known_failure,
        ),
        Check("aqt_convert", aqt.check_aqt_convert, _ON_MESH, capability="aqt"),
        Check(
            "aqt_serve",
            aqt.check_aqt_serve,
            ("family", "scan_layers"),
            where="primary",
            capability="aqt",
            workdir=True,
        ),
        # checkpoint
        Check(
            "checkpoint_roundtrip",
            checkpoint.check_checkpoint_roundtrip,
            _ON_MESH,
            _BACKENDS,
            workdir=True,
            saved_on=True,
            pair=False,
        ),
        Check(
            "checkpoint_conversion",
            checkpoint.check_checkpoint_conversion,
            ("family",),
            _CONVERSIONS,
            where="primary",
            workdir=True,
        ),
        # cost
        Check(
            "cost",
            cost.check_cost,
            ("family", "scan_layers"),
            where="primary",
            golden=True,
            golden_by_platform=True,
        ),
        Check(
            "tpu_compile",
            tpu.check_tpu_compile,
            ("family", "tpu"),
            where="tpu",
            devices=False,
            golden=True,
            given=("tpu",),
        ),
        # decode
        Check(
            "decode_cache",
            decode.check_decode_cache,
            _ON_MESH,
            capability="decode",
            golden=True,
        ),
        Check(
            "decode_consistency",
            decode.check_decode_consistency,
            _ON_MESH,
            capability="decode",
        ),
        Check("decode", decode.check_decode, _ON_MESH, capability="decode"),
        # forward
        Check("forward", forward.check_forward, (*_ON_MESH, "dtype")),
        # structure
        Check("init", structure.check_init, _ON_MESH, suite="init"),
        Check(
            "structure",
            structure.check_structure,
            ("family", "size", "scan_layers"),
            where="none",
            devices=False,
            golden=True,
            pair=False,
        ),
        Check(
            "provenance",
            structure.check_provenance,
            ("family", "scan_layers"),
            where="none",
            devices=False,
            pair=False,
            requires=_declares_bridges,
        ),
        Check(
            "sharding",
            structure.check_sharding,
            _ON_MESH,
            golden=True,
            pair=False,
            suite="sharding",
        ),
        Check(
            "sharding_topology",
            structure.check_sharding,
            ("family", "full_size", "topology", "scan_layers"),
            where="topology",
            devices=False,
            golden=True,
            pair=False,
            suite="sharding",
        ),
        # quantization
        Check(
            "quant_params",
            quantization.check_quant_params,
            (*_ON_MESH, "quant"),
            devices=False,
            golden=True,
        ),
        Check(
            "quant_forward",
            quantization.check_quant_forward,
            (*_ON_MESH, "quant"),
            known_failure=_qwix_known_failure,
        ),
        Check(
            "quant_hygiene",
            quantization.check_quant_hygiene,
            ("family", "scan_layers", "quant"),
            where="primary",
            devices=False,
        ),
        Check(
            "quant_hygiene_topology",
            quantization.check_quant_hygiene_topology,
            ("family", "full_size", "topology"),
            where="topology",
            devices=False,
            requires=_declares_topology_mode,
        ),
        Check(
            "qat_train_step",
            quantization.check_qat_train_step,
            (*_ON_MESH, "quant"),
            quant_method="qat",
        ),
        Check(
            "quant_checkpoint",
            quantization.check_quant_checkpoint,
            ("family", "scan_layers", "quant"),
            where="primary",
            quant_method="ptq",
            workdir=True,
        ),
        # recorded references
        _against_recorded("recorded_forward", recorded.check_recorded_forward),
        _against_recorded("recorded_train_step", recorded.check_recorded_train_step),
        _against_recorded("recorded_resume", recorded.check_recorded_resume),
        _against_recorded("recorded_decode", recorded.check_recorded_decode, capability="decode"),
        _against_recorded(
            "recorded_quant_forward",
            recorded.check_recorded_quant_forward,
            ("family", "quant", "recorded"),
            known_failure=_recorded_qwix_known_failure,
        ),
        # sharding invariance
        Check(
            "sharding_invariance",
            invariance.check_sharding_invariance,
            _ON_MESH,
            _BACKENDS,
            pair=False,
        ),
        # state hygiene outside training
        Check(
            "state_hygiene",
            state.check_state_hygiene,
            ("family", "scan_layers"),
            where="none",
            devices=False,
            workdir=True,
            pair=False,
        ),
        # training
        Check("train_step", training.check_train_step, _ON_MESH),
        Check(
            "grad_accumulation",
            training.check_grad_accumulation,
            _ON_MESH,
            requires=_additive_loss,
        ),
        Check(
            "layout",
            training.check_layout,
            ("family", "mesh"),
            _LAYOUT_VARIANTS,
            layouts=(False,),
        ),
        Check("hygiene", training.check_hygiene, _ON_MESH),
        Check(
            "resume",
            training.check_resume,
            ("family",),
            _BACKENDS,
            where="primary",
            workdir=True,
            pair=False,
        ),
        Check(
            "resume_conversion",
            training.check_resume_conversion,
            ("family",),
            where="primary",
            workdir=True,
        ),
        Check(
            "optimizer_sharding",
            training.check_optimizer_sharding,
            _ON_MESH,
            devices=False,
            golden=True,
        ),
        Check(
            "dropout",
            training.check_dropout,
            ("family", "scan_layers"),
            where="primary",
            capability="dropout",
        ),
        Check(
            "vocab_tiling",
            training.check_vocab_tiling,
            _ON_MESH,
            capability="vocab_tiling",
        ),
        Check(
            "fp8_train_step",
            training.check_fp8_train_step,
            ("family", "scan_layers"),
            where="primary",
            capability="fp8",
        ),
        Check(
            "aux_losses",
            training.check_aux_losses,
            _ON_MESH,
            capability="aux_losses",
        ),
    )
}
"""Every registered check, by name."""


def case_of(check: Check, values: Mapping[str, Any], mesh: MeshSpec | None, devices: Any) -> Case:
    """The case a test of ``check`` runs on, from its axis values and its mesh.

    Axes a check is not parametrized over take their defaults: the family's device
    size, its preferred layer layout, float32, no quantization. A TPU compile (axis
    ``tpu``) brings its size, layout and the slice's devices; at production sizes it
    computes in bfloat16, as production trains.
    """
    family = values["family"]
    size = values.get("size") or values.get("full_size")
    scan, dtype = values.get("scan_layers"), values.get("dtype", jnp.float32)
    if (compile_ := values.get("tpu")) is not None:
        size, scan, devices = compile_.size, compile_.scan_layers, compile_.target.devices()
        dtype = jnp.bfloat16 if compile_.target.production else dtype
    return Case.of(
        family,
        size,
        scan_layers=scan,
        dtype=dtype,
        mesh=mesh,
        devices=devices,
        quant=values.get("quant"),
    )


def mesh_of(check: Check, values: Mapping[str, Any], primary: MeshSpec) -> MeshSpec | None:
    """The mesh a test of ``check`` runs on: its own, the run's ``primary`` one, or none."""
    match check.where:
        case "each":
            return values["mesh"]
        case "topology":
            return values["topology"]
        case "tpu":
            return values["tpu"].target.mesh
        case "primary":
            return primary
        case _:
            return None


class UnknownCheck(LookupError):
    """A check name the registry does not know."""


def get(name: str) -> Check:
    """The registered check called ``name``; :class:`UnknownCheck` lists the known ones."""
    if name not in CHECKS:
        raise UnknownCheck(f"unknown check {name!r}; known checks: {', '.join(sorted(CHECKS))}")
    return CHECKS[name]
