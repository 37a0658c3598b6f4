"""Run one registered check as the suite would, outside the suite: the fault and benign
catalogues' shared runner."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from conformance.checks import registry
from conformance.contract import Family, Pair
from conformance.core.references import references_root
from conformance.core.sharding import MeshSpec, parse_mesh
from conformance.core.tpu import TpuCompile
from conformance.pytest_plugin.session import DTYPES
from conformance_models import GOLDENS

TOPOLOGY = parse_mesh("4x8x8")


def run_check(
    name: str,
    family: Family,
    workdir: Path,
    mesh: MeshSpec,
    *,
    size: str = "tiny",
    quant: str | None = None,
    params: Mapping[str, Any] | None = None,
    references: Path | None = None,
    scan_layers: bool | None = None,
    tpu: TpuCompile | None = None,
    dtype: Any = jnp.float32,
    pair: Pair = Pair.LINEN_NNX,
) -> Any:
    """Run check ``name`` on ``family`` through the registry, on ``mesh``, in ``dtype``.

    A check against a recorded reference reads it from ``references`` (default: the
    repository's), recorded from Linen unless ``params`` say otherwise; a TPU compile
    (``tpu_compile``) compiles for ``tpu``.
    """
    check = registry.get(name)
    params = dict(params or {})
    values = {
        "family": family,
        "size": size,
        "scan_layers": params.get("layouts", (scan_layers,))[0] or False,
        "dtype": dtype,
        "quant": quant,
        "mesh": mesh,
        "topology": TOPOLOGY,
        "tpu": tpu,
        "pair": pair,
    }
    target = registry.mesh_of(check, values, mesh)
    devices = target.devices() if check.devices and target is not None else None
    case = registry.case_of(check, values, target, devices)
    params.update({axis: values[axis] for axis in check.given})
    if check.workdir:
        params["workdir"] = workdir
    if check.saved_on:
        params["saved_on"] = case.on(mesh)
    if check.references:
        params.setdefault("recorded", "linen")
        params["references"] = references or references_root(GOLDENS)
    return check(case, **params)


def facets(
    mesh: MeshSpec,
    quant: str | None,
    params: Mapping[str, Any] | None = None,
    *,
    costly_tpu_production: bool = False,
    dtype: Any = jnp.float32,
    pair: Pair = Pair.LINEN_NNX,
) -> dict[str, object]:
    """What a tier narrows the test that would run such a check by."""
    layouts = tuple(bool(s) for s in (params or {}).get("layouts", (0, 0)))
    dtype_id = next(name for name, known in DTYPES.items() if known == dtype)
    found = {"mesh": mesh, "scan_layers": False, "dtype": dtype_id, "layouts": layouts}
    found["costly_tpu_production"] = costly_tpu_production
    if pair != Pair.LINEN_NNX:
        found["mode_pair"] = True
    return found | ({"quant": quant} if quant else {})
