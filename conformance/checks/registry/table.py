"""The table of every registered check, and why a case of one fails or cannot run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from conformance.checks import (
    aqt,
    checkpoint,
    cost,
    decode,
    forward,
    invariance,
    quantization,
    recorded,
    state,
    structure,
    tpu,
    training,
)
from conformance.checks.registry.check import Check, Param
from conformance.contract import Family
from conformance.runtime import aqt as aqt_runtime
from conformance.runtime import quant
from conformance.runtime.sides import SIDES


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

BUILTIN: dict[str, Check] = {
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
            checkpoint.check_resume,
            ("family",),
            _BACKENDS,
            where="primary",
            workdir=True,
            pair=False,
            suite="train_step",
        ),
        Check(
            "resume_conversion",
            checkpoint.check_resume_conversion,
            ("family",),
            where="primary",
            workdir=True,
            suite="train_step",
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
"""The checks this package ships, by name."""
