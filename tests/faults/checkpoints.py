"""Faults in checkpoints: conversion between backends and layouts, strict restores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from conformance import families
from conformance.contract import Pair
from conformance.core.failure import checking, fail
from conformance.core.trees import restack
from conformance.runtime.case import Case
from conformance.runtime.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    cast_counters,
    expected_layout,
    restore,
    save,
)
from conformance.runtime.sides import NnxSide
from conformance.runtime.train_state import flat_state
from conformance_models.llama.family import LlamaFamily
from tests.faults.fault import Fault, Llama


def drops_final_norm(state, to):
    """The converter's path step, losing every ``final_norm/scale`` leaf."""
    return {p: v for p, v in to(state).items() if not p.endswith("final_norm/scale")}


def swaps_moments(state, to):
    """The converter's path step, writing Adam's mu as nu and nu as mu."""
    swap = {"/mu/": "/nu/", "/nu/": "/mu/"}

    def swapped(path):
        for old, new in swap.items():
            if old in path:
                return path.replace(old, new)
        return path

    return {swapped(p): v for p, v in to(state).items()}


def stacks_on_next_axis(flat, table, to_scan, axis=0):
    """``restack`` that stacks layers on the axis after the family's ``Layouts.axis``."""
    stacked = restack(flat, table, to_scan, axis)
    if not to_scan:
        return stacked
    stacked_paths = tuple(table)
    return {
        p: np.moveaxis(v, axis, axis + 1) if p.endswith(stacked_paths) and np.ndim(v) > 1 else v
        for p, v in stacked.items()
    }


def loses_step(state, target):
    """``cast_counters`` that also resets the step counter to 0."""
    cast = cast_counters(state, target)
    return {p: np.zeros_like(v) if p == "optimizer/step" else v for p, v in cast.items()}


def zeroes_moments(tree):
    """A restore that leaves Adam's moments at zero (MaxText #3929)."""
    return {p: np.zeros_like(v) if "/mu/" in p or "/nu/" in p else v for p, v in tree.items()}


def saved_in_bfloat16(tree):
    """A checkpoint that stores float state in the compute dtype, here bfloat16.

    As orbax's ``SaveArgs(dtype=config.dtype)`` would: a no-op under float32 compute,
    so only a resume in bfloat16 compute shows it. The restored parameters and Adam
    moments are the saved ones rounded to bfloat16, back in float32.
    """
    return {
        p: v.astype(jnp.bfloat16).astype(v.dtype) if v.dtype == jnp.float32 else v
        for p, v in tree.items()
    }


def restarts_step(tree):
    """A restore that resets the step counter: the schedule and the dropout keys restart."""
    return {p: np.zeros_like(v) if p == "optimizer/step" else v for p, v in tree.items()}


class RenamedLeaf(LlamaFamily):
    """NNX names the final norm ``norm_f``: a checkpoint of the real llama must not load."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.norm_f = model.final_norm
        del model.final_norm
        return model


def restore_real_checkpoint(fault: Fault, workdir: Path) -> None:
    """Save the real family's NNX train state; restore it strictly into the faulty one's."""
    real = families.get(fault.family.name)
    trainer = NnxSide(Case.of(real, fault.size, scan_layers=False)).trainer()
    state = flat_state(trainer.initial_state(trainer.runner.init(0)))
    save(workdir / "real", state, CheckpointInfo(real.name, fault.size, "nnx", False))
    config = fault.family.config(fault.size, scan_layers=False)
    with checking(fault.family.name, "checkpoint_roundtrip"):
        try:
            restore(workdir / "real", expected_layout(fault.family, config, "nnx"))
        except CheckpointError as err:
            fail(str(err))


_CONVERSION = {"source": "linen", "layouts": (False, False)}

_RESUME_CONVERSION = (
    Fault(
        Llama(),
        "resume_conversion",
        ("step 3 of 4", "NNX resumed from Linen's checkpoint of step 2", "/mu/"),
        seams={"convert_paths": swaps_moments},
    ),
    Fault(
        Llama(),
        "resume_conversion",
        ("step 3 of 4", "state/optimizer/step:"),
        seams={"convert_cast_counters": loses_step},
    ),
    Fault(
        Llama(),
        "resume_conversion",
        (
            "step 3 of 4",
            "NNX explicit sharding resumed from NNX auto sharding's checkpoint of step 2",
            "state/optimizer/step:",
        ),
        seams={"convert_cast_counters": loses_step},
        pair=Pair.AUTO_EXPLICIT,
    ),
)

FAULTS = (
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("model/final_norm/scale: in the target, missing from the checkpoint",),
        seams={"convert_paths": drops_final_norm},
        params=_CONVERSION,
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        (
            "model/layers/mlp/gate/kernel: checkpoint float32[64, 2, 128]",
            "!= target float32[2, 64, 128]",
        ),
        seams={"convert_restack": stacks_on_next_axis},
        params={"source": "linen", "layouts": (False, True)},
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("next train step", "state/optimizer/opt_state/1/0/mu/"),
        seams={"convert_paths": swaps_moments},
        params=_CONVERSION,
    ),
    Fault(
        Llama(),
        "checkpoint_conversion",
        ("next train step", "state/optimizer/step:"),
        seams={"convert_cast_counters": loses_step},
        params=_CONVERSION,
    ),
    Fault(
        Llama(),
        "resume",
        ("NNX state restored from the checkpoint of step 2", "optimizer/opt_state/1/0/mu/"),
        seams={"checkpoint_restored": zeroes_moments},
        params={"backend": "nnx"},
    ),
    Fault(
        Llama(),
        "resume",
        ("Linen state restored from the checkpoint of step 2", "optimizer/step:"),
        seams={"checkpoint_restored": restarts_step},
        params={"backend": "linen"},
    ),
    Fault(
        Llama(),
        "resume",
        ("NNX state restored from the checkpoint of step 2", "model/lm_head/kernel: 16384 of"),
        seams={"checkpoint_restored": saved_in_bfloat16},
        params={"backend": "nnx"},
        dtype=jnp.bfloat16,
    ),
    *_RESUME_CONVERSION,
    *(
        dataclasses.replace(
            fault,
            dtype=jnp.bfloat16,
            expect=(
                *fault.expect,
                "(bfloat16 compute)",
                "the float32 steps disagree too",
                "a divergence the lower precision carries, not rounding",
            ),
        )
        for fault in _RESUME_CONVERSION
    ),
    Fault(
        RenamedLeaf(),
        "checkpoint_roundtrip",
        (
            "model/norm_f/scale: in the target, missing from the checkpoint",
            "model/final_norm/scale: in the checkpoint, not in the target",
        ),
        scenario=restore_real_checkpoint,
    ),
)
