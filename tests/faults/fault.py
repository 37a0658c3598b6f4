"""What a planted fault is: a faulty family or seam, the check that must catch it, the words.

A fault is planted in one of three places, each public:

* a family (a built-in family with one method overridden, so it breaks exactly one
  thing on one backend);
* a seam of the harness (:mod:`conformance.core.seams`: a step of the runtime replaced
  for the check's duration);
* a built-in model's own code (a method of one of its layer classes replaced), for
  faults that must reach every instance of a shared layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from conformance.contract import Pair
from conformance.core.sharding import MeshSpec
from conformance.core.tpu import TpuCompile
from conformance.families import Family
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.llama.family import LlamaFamily
from conformance_models.moe.family import MoeFamily
from tests.suite_run import run_check


@dataclasses.dataclass(frozen=True)
class Fault:
    """A faulty family, the check that must catch it, and what its report must say.

    With ``seams`` or ``model_patch`` the fault is planted outside the family, around
    the check; the family is then a fresh unchanged instance, so no cached runner,
    trainer or decoder outlives the fault.
    """

    family: Family
    check: str
    expect: tuple[str, ...]
    size: str = "tiny"
    seams: Mapping[str, Callable[..., Any]] = MappingProxyType({})
    """Seams replaced while the check runs (:func:`conformance.core.seams.planted`)."""
    model_patch: tuple[Any, str, Any] | None = None
    """``(class, method name, replacement)`` in a built-in model's own code."""
    params: Mapping[str, Any] = MappingProxyType({})
    """The check's own parameters (``backend``, ``source``, ``layouts``, ``variant``)."""
    quant: str | None = None
    scan_layers: bool | None = None
    """The layer layout the check runs in (default: a layer list, or what the check's
    ``layouts`` parameter says)."""
    mesh_axes: tuple[str, ...] = ()
    """Mesh axes the fault needs at size 2 or more to show (a partitioning fault)."""
    dtype: Any = jnp.float32
    """The compute dtype the check runs in, for a check with a ``dtype`` axis."""
    pair: Pair = Pair.LINEN_NNX
    """The sides the check compares, for a check with a ``pair`` axis."""
    scenario: Callable[..., None] | None = None
    """Run instead of the check: ``scenario(fault, workdir)`` (a fault in what a check is
    handed, such as another model's checkpoint, rather than in the family)."""

    def run(self, workdir: Path, mesh: MeshSpec, tpu: TpuCompile | None = None) -> None:
        """Run the fault's check as the suite would, on ``mesh`` (or its scenario instead).

        A TPU compile's fault compiles for ``tpu``.
        """
        if self.scenario is not None:
            self.scenario(self, workdir)
            return
        run_check(
            self.check,
            self.family,
            workdir,
            mesh,
            size=self.size,
            quant=self.quant,
            params=self.params,
            scan_layers=self.scan_layers,
            tpu=tpu,
            dtype=self.dtype,
            pair=self.pair,
        )

    @property
    def production(self) -> bool:
        """Whether it is planted at a production size (a TPU compile's, on a large slice)."""
        return self.size != self.family.device_size

    @property
    def id(self) -> str:
        """Test id: the check and the fault's class name, or what was replaced.

        A fault planted below float32 compute ends in its dtype (``@bfloat16``); one on a
        mode pair names it after the check (``train_step[graph-vs-tree]``).
        """
        dtype = "" if self.dtype == jnp.float32 else f"@{jnp.dtype(self.dtype).name}"
        check = f"{self.check}[{self.pair.id}]" if self.pair.id else self.check
        if self.seams:
            planted = ",".join(f"{k}={v.__name__.lstrip('_')}" for k, v in self.seams.items())
            return f"{check}:{planted}{dtype}"
        if self.model_patch is not None:
            owner, name, replacement = self.model_patch
            where = owner.__name__.rsplit(".", 1)[-1]
            return f"{check}:{where}.{name}={replacement.__name__.lstrip('_')}{dtype}"
        scale = f"@{self.size}" if self.production else ""
        return f"{check}:{type(self.family).__name__}{scale}{dtype}"


class NnxConfigFault:
    """Build the NNX side from a config with some fields changed (Linen keeps the original)."""

    changes: ClassVar[dict[str, Any]] = {}

    def nnx_module(self, config: Any, rngs: nnx.Rngs) -> nnx.Module:
        return super().nnx_module(dataclasses.replace(config, **self.changes), rngs)


class Llama(LlamaFamily):
    """An unchanged llama, for faults planted in a seam or the model's code instead."""


class Gpt3(Gpt3Family):
    """An unchanged gpt3, for faults planted in a seam or the model's code instead."""


class Moe(MoeFamily):
    """An unchanged moe, for faults planted in a seam or the model's code instead."""
