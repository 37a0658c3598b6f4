"""The AQT (aqtp) int8 recipe every built-in projection uses when a config asks for AQT.

One Linen ``AqtDotGeneral`` per projection: weights and activations in int8, gradients in
int8, no stochastic rounding (so both backends are deterministic). The NNX side wraps the
same module with ``nnx.bridge.ToNNX``, as AQT has no NNX-native layer. In ``convert``
mode the quantized kernel (``qvalue`` int8 plus ``scale``) is written to the ``aqt``
collection; in ``serve`` mode it is read from there and the float kernel is not needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax
from aqt.jax.v2.utils import QuantMode
from flax import linen as nn
from flax import nnx

AqtMode = Literal["train", "convert", "serve"]

COLLECTION = "aqt"
"""The Linen collection (and, through the bridge, the NNX Variable type) of frozen kernels."""

_QUANT_MODES: dict[str, QuantMode] = {
    "train": QuantMode.TRAIN,
    "convert": QuantMode.CONVERT,
    "serve": QuantMode.SERVE,
}


def _logical_wrapper(axis_names: Sequence[str]) -> aqt_flax.AxisMetadataWrapper:
    """Annotate a frozen tensor with the kernel's logical names (``None`` on reduced axes)."""

    def wrap(
        x: jax.Array, tile_map: object, no_sharding_axes: Sequence[int]
    ) -> nn.LogicallyPartitioned:
        del tile_map
        names = tuple(None if i in no_sharding_axes else n for i, n in enumerate(axis_names))
        return nn.LogicallyPartitioned(x, names)

    return wrap


def dot_general(mode: AqtMode, kernel_axis_names: Sequence[str]) -> aqt_flax.AqtDotGeneral:
    """An int8 ``AqtDotGeneral`` in ``mode`` for a kernel with ``kernel_axis_names``."""
    return aqt_flax.AqtDotGeneral(
        aqt_config.fully_quantized(fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False),
        prng_name=None,
        rhs_quant_mode=_QUANT_MODES[mode],
        rhs_freeze_mode=aqt_flax.FreezerMode.CALIBRATION_AND_VALUE,
        rhs_axis_metadata_wrapper=_logical_wrapper(kernel_axis_names),
        quant_collection=COLLECTION,
        use_legacy_freezer=False,
    )


class BridgedDotGeneral(nnx.bridge.ToNNX):
    """A Linen dot-general module bridged into NNX, usable under ``nnx.capture``.

    It bridges AQT's ``AqtDotGeneral`` and Flax's FP8 ``Fp8DirectDotGeneralOp``. In
    flax 0.12.12: ``nnx.capture`` sets a ``__captures__`` attribute on every submodule,
    and ``ToNNX`` hands all its attributes to Linen, which fails with "Cannot infer
    collection name from value: (Intermediate(...),)". These modules sow nothing, so the
    attribute is set aside for the duration of the call.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the bridged Linen module with ``nnx.capture``'s bookkeeping set aside."""
        captures = vars(self).pop("__captures__", None)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if captures is not None:
                vars(self)["__captures__"] = captures
