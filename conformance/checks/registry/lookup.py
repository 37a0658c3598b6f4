"""A check by name, and the case and mesh one of its tests runs on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from conformance.checks.declare import Check
from conformance.checks.registry.zoo import checks, installed
from conformance.contract import Pair
from conformance.core.sharding import MeshSpec
from conformance.runtime.case import Case


def case_of(check: Check, values: Mapping[str, Any], mesh: MeshSpec | None, devices: Any) -> Case:
    """The case a test of ``check`` runs on, from its axis values and its mesh.

    Axes a check is not parametrized over take their defaults: the family's device
    size, its preferred layer layout, float32, no quantization, Linen against NNX. A
    TPU compile (axis ``tpu``) brings its size, layout and the slice's devices; at
    production sizes it computes in bfloat16, as production trains.
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
        pair=values.get("pair", Pair.LINEN_NNX),
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
    registered = checks()
    if name not in registered:
        known = ", ".join(sorted(registered))
        problems = "".join(f"; {problem}" for problem in installed().problems)
        raise UnknownCheck(f"unknown check {name!r}; known checks: {known}{problems}")
    return registered[name]
