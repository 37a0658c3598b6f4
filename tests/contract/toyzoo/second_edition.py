"""The first-edition toy families written again in the contract's second edition.

Each declares in :meth:`~conformance.families.Family.features` what its twin in
:mod:`toyzoo.families` declares with ``Capabilities`` flags and hooks, spelt as the
``FirstEditionWarning`` on the twin suggests; modules, batches and paths are the same.
``tests/contract/test_second_edition.py`` shows the suite plans the same tests for both,
with the same skips and expected failures, and that each feature gives the same configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from conformance.families import (
    AuxLosses,
    Capabilities,
    Decode,
    Dropout,
    Feature,
    Layouts,
    PathRules,
    Qwix,
    Remat,
)

from . import families as first
from .models import ToyConfig
from .moe import AUX_LOSS


class ToyFull(first.ToyMinimal):
    """Both layouts (stack rules in canonical paths), remat and dropout, decode, Qwix QAT."""

    name = "toy-full"
    unsupported: Mapping[str, str] = MappingProxyType({})
    train_rngs = ("dropout",)

    def features(self) -> Sequence[Feature]:
        return (
            Layouts((True, False), self.stack_rules),
            Remat(self.remat_config),
            Dropout(self.dropout_config),
            Decode(),
            Qwix(frozenset({"qat_int8"})),
        )

    def train_kwargs(self, config: ToyConfig) -> Mapping[str, Any]:
        return {"train": True}

    def remat_config(self, config: ToyConfig) -> ToyConfig:
        return dataclasses.replace(config, checkpointed=True, dropout=0.0)

    def dropout_config(self, config: ToyConfig, rate: float) -> ToyConfig:
        return dataclasses.replace(config, checkpointed=False, dropout=rate)

    def stack_rules(self, config: ToyConfig) -> PathRules:
        return ((r"^blocks/(?P<layer>\d+)/", "blocks/"),)


class ToyLm(first.ToyLm):
    """Token-by-token decoding through ``decode_config``, as a :class:`Decode` feature."""

    capabilities = Capabilities()

    def features(self) -> Sequence[Feature]:
        return (Decode(style="token", config=self.decode_config),)


class ToyMoe(first.ToyMoe):
    """The load-balancing loss as an :class:`AuxLosses` feature."""

    capabilities = Capabilities()

    def features(self) -> Sequence[Feature]:
        return (AuxLosses((AUX_LOSS,)), *super().features())
