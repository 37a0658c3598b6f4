"""The maxtext releases the adapter supports, and what changes between them.

``0.2.4`` is the last release with two implementations: its pure Linen
``TransformerLinenPure`` and its NNX ``Transformer``, chosen by three config switches.
``0.2.5`` deleted Linen: its Linen face is ``TransformerLinen``, a ``ToLinen`` bridge
around the NNX ``Transformer``, and its config refuses the switches. Nothing here
imports maxtext.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

SUPPORTED = ("0.2.4", "0.2.5")
"""The maxtext releases the adapter runs, oldest first."""

CURRENT = SUPPORTED[-1]
"""MaxText's current release: the one CI gates against the recorded references."""

BRIDGED = frozenset({"0.2.5"})
"""Releases whose Linen side is the ``ToLinen`` bridge around the NNX model."""

_SWITCHES: Mapping[str, Mapping[str, bool]] = MappingProxyType(
    {
        "linen": {"pure_nnx": False, "enable_nnx": False, "pure_nnx_decoder": False},
        "nnx": {"pure_nnx": True, "enable_nnx": True, "pure_nnx_decoder": True},
    }
)
"""maxtext 0.2.4's switches for its pure Linen and its NNX model (later releases have none)."""

INSTALL_HINT = f"make setup-maxtext MAXTEXT={CURRENT}, or MAXTEXT={SUPPORTED[0]}"
"""How to install a supported maxtext in its own venv."""


@functools.cache
def installed() -> str | None:
    """The installed maxtext version, or ``None`` when maxtext is not installed."""
    try:
        return importlib.metadata.version("maxtext")
    except importlib.metadata.PackageNotFoundError:
        return None


def unsupported() -> str | None:
    """Why the installed maxtext cannot run (one line), or ``None`` when it can."""
    version = installed()
    if version is None:
        return f"maxtext is not installed ({INSTALL_HINT})"
    if version not in SUPPORTED:
        return f"maxtext {version} is installed; the adapter supports {', '.join(SUPPORTED)}"
    return None


def bridged() -> bool:
    """Whether the installed release's Linen side is the ``ToLinen`` bridge (no own Linen)."""
    return installed() in BRIDGED


def switches(backend: str) -> Mapping[str, bool]:
    """The config keys that pick ``backend``'s implementation in the installed release."""
    return {} if bridged() else _SWITCHES[backend]


_STACKED_ROUTING_BIAS = re.compile(r"^decoder/moe_layers/(?:.+/)?gate/bias$")
"""The MoE routing bias of scanned layers: 0.2.4 stacks it on axis 1, 0.2.5 on axis 0."""


def upgrade(leaves: Mapping[str, Any], recorded: str) -> dict[str, Any]:
    """Leaves recorded with maxtext ``recorded``, in the installed release's paths and shapes.

    The version map from 0.2.4 to 0.2.5: the MoE routing bias left ``nnx.Param`` for its
    own Variable type (``MoEBiasVar``), which scanned layers stack on axis 0 where
    parameters stack on MaxText's ``param_scan_axis`` 1 (``[experts, layers]`` became
    ``[layers, experts]``); unrolled layers keep its shape. Every other 0.2.5 rename is
    of a logical axis name (``embed`` to ``embed_attn`` in attention, ``embed_moe`` to
    ``embed_router``), which a reference does not hold. Raises ``ValueError`` for a pair
    of releases without a map.
    """
    now = installed()
    if recorded == now:
        return dict(leaves)
    if (recorded, now) != ("0.2.4", "0.2.5"):
        raise ValueError(f"no version map from maxtext {recorded} to {now}")
    return {
        path: np.moveaxis(value, 1, 0) if _STACKED_ROUTING_BIAS.match(path) else value
        for path, value in leaves.items()
    }
