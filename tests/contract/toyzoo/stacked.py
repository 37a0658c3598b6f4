"""A zoo whose Linen side stacks two projections in one leaf where NNX has two kernels.

Each block's gated MLP keeps its gate and up projections in Linen as one ``[2, D, H]``
parameter ``gate_up``, applied by one einsum; NNX has two ``nnx.Linear`` kernels, ``gate``
and ``up``. The family maps them with a :class:`~conformance.families.Split` rule, so
structure, sharding, numbers, checkpoints and Qwix PTQ's stored parameters compare
slice by slice. Otherwise it is ``toy-fn``: its cache is a value. Qwix PTQ quantizes its einsums
too, so both sides store quantized projections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from conformance.families import Divergence, Feature, PathRules, QuantScope, Qwix, Split

from .families import ToyFn
from .functional import Cache, LinenFn, NnxFn, _mix
from .models import INIT, ToyConfig


class LinenStackedBlock(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, cache: Cache | None
    ) -> tuple[jax.Array, Any]:
        mixed, cache = _mix(x, segment_ids, cache)
        width = self.config.width
        init = nn.with_logical_partitioning(INIT, (None, "embed", "mlp"))
        gate_up = self.param("gate_up", init, (2, width, width))
        gate, up = jnp.einsum("bsd,kdh->kbsh", mixed, gate_up)
        return x + gate * jax.nn.sigmoid(up), cache


class NnxStackedBlock(nnx.Module):
    def __init__(self, config: ToyConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(INIT, ("embed", "mlp"))
        width = config.width
        self.gate = nnx.Linear(width, width, use_bias=False, kernel_init=init, rngs=rngs)
        self.up = nnx.Linear(width, width, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array, cache: Cache | None
    ) -> tuple[jax.Array, Any]:
        mixed, cache = _mix(x, segment_ids, cache)
        return x + self.gate(mixed) * jax.nn.sigmoid(self.up(mixed)), cache


class ToyStacked(ToyFn):
    """:class:`ToyFn` with each block's two projections stacked in one Linen leaf."""

    name = "toy-stacked"
    known_divergences = (
        Divergence(
            "cost",
            "NNX runs the two projections as two matmuls where Linen runs one einsum over "
            "the stacked leaf: its train step gathers and reduces more, a real cost",
        ),
    )

    def features(self) -> Sequence[Feature]:
        decode, _ = super().features()
        scope = QuantScope(op_names=("dot_general", "einsum"))
        return (decode, Qwix(frozenset({"ptq_int8"}), scope=lambda config: scope))

    def linen_module(self, config: ToyConfig) -> nn.Module:
        return LinenFn(config, block=LinenStackedBlock)

    def nnx_module(self, config: ToyConfig, rngs: nnx.Rngs) -> nnx.Module:
        return NnxFn(config, rngs, block=NnxStackedBlock)

    def path_rules(self, config: ToyConfig) -> PathRules:
        gate_up = Split(r"^block_(\d+)/gate_up", (r"blocks/\1/gate/kernel", r"blocks/\1/up/kernel"))
        return (gate_up, *super().path_rules(config))
