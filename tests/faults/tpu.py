"""Faults only a TPU compile at production size sees plainly, each with numbers equal to Linen's.

An output head NNX replicates, whose gradient the compiler places differently; and the same
faulty families as the ``cost`` check's (:mod:`tests.faults.cost`), compiled
by libtpu for a TPU slice: at the device size on a small slice, and at llama's ``8b``
on a production slice, scanned as production trains, where a lost remat no longer fits
the chip, nor, with a per-layer copy of a read-only table, does NNX's forward (the
out-of-memory that MaxText's stacked read-only parameters gave DeepSeek-V3), and where
a kernel NNX shards on other mesh axes is named at the sharding each program holds it
in, beside the collectives it changes. At the device size libtpu's own scheduling keeps
a step without remat within Linen's memory: dropping remat shows as the all-reduces
Linen's recomputed forward runs and NNX's does not.
"""

from __future__ import annotations

from conformance_models.llama.family import LlamaFamily
from tests.faults.cost import (
    NnxDropsRemat,
    NnxMovesKernel,
    NnxReplicatesKernel,
    NnxScanStacksReadOnlyTable,
)
from tests.faults.fault import Fault

_COMPILED = "compiled for TPU"


class NnxReplicatesHead(LlamaFamily):
    """NNX replicates the output head Linen shards: the same logits (both sides constrain
    them), and a gradient the compiler places whole along the model dimension, where
    Linen's is split over ``fsdp``."""

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.lm_head.kernel.set_metadata(out_sharding=(None, None))
        return model


FAULTS = (
    Fault(
        NnxReplicatesHead(),
        "tpu_compile",
        (
            _COMPILED,
            "train_step: metrics/grads/lm_head/kernel placed by the compiler as Linen "
            "['fsdp', 'tensor'] but NNX [None, 'tensor']",
        ),
        mesh_axes=("fsdp",),
    ),
    Fault(
        NnxDropsRemat(),
        "tpu_compile",
        (_COMPILED, "train_step (remat): all-reduce Linen"),
        scan_layers=True,
    ),
    Fault(
        NnxReplicatesKernel(),
        "tpu_compile",
        (_COMPILED, "train_step: all-"),
        mesh_axes=("fsdp",),
        scan_layers=True,
    ),
    Fault(
        NnxScanStacksReadOnlyTable(),
        "tpu_compile",
        (_COMPILED, "forward: argument_bytes NNX"),
        scan_layers=True,
    ),
    Fault(
        NnxMovesKernel(),
        "tpu_compile",
        (
            _COMPILED,
            "forward: params/layers/0/mlp/down/kernel held by the program as Linen "
            "['tensor', 'fsdp'] but NNX ['fsdp', 'tensor']",
        ),
        mesh_axes=("fsdp", "tensor"),
    ),
    Fault(
        NnxDropsRemat(),
        "tpu_compile",
        (_COMPILED, "NNX train_step (remat) does not fit a v5p chip"),
        size="8b",
        scan_layers=True,
    ),
    Fault(
        NnxMovesKernel(),
        "tpu_compile",
        (
            _COMPILED,
            "train_step (remat): state/model/layers/mlp/down/kernel held by the program as "
            "Linen [None, 'tensor', 'fsdp'] but NNX [None, 'fsdp', 'tensor']",
            "train_step (remat): all-",
        ),
        size="8b",
        scan_layers=True,
    ),
    Fault(
        NnxScanStacksReadOnlyTable(),
        "tpu_compile",
        (_COMPILED, "NNX forward does not fit a v5p chip"),
        size="8b",
        scan_layers=True,
    ),
)
"""Faults of the ``tpu_compile`` check, at the device size and at production size."""
