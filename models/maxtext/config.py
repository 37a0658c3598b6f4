"""The harness-side config of a MaxText family and its MaxText ``HyperParameters``."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from conformance_models.maxtext import releases

SEQ_LEN = 16
"""Tokens per row of every batch (MaxText's ``max_target_length``)."""

_FIXED: Mapping[str, Any] = {
    "run_name": "conformance",
    "enable_checkpointing": False,
    "skip_jax_distributed_system": True,
    "per_device_batch_size": 1,
    "max_target_length": SEQ_LEN,
    "max_prefill_predict_length": SEQ_LEN // 2,
    "attention": "dot_product",
    "weight_dtype": "float32",
    "enable_dropout": True,
    "jax_cache_dir": "",
}
"""Overrides every size of every family gets: tiny CPU-friendly shapes, reference
attention, float32 weights.

``jax_cache_dir`` is emptied because MaxText's config initialisation otherwise turns on
jax's persistent compilation cache for the whole process (``compilation_cache.
set_cache_dir("~/jax_cache")``, base.yml's default): the harness keeps that cache opt-in
(``JAX_COMPILATION_CACHE_DIR``), for every family alike."""


def _frozen(value: Any) -> Any:
    """A yaml value made hashable: lists become tuples."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def _thawed(value: Any) -> Any:
    """The yaml value back from :func:`_frozen`: tuples become lists."""
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True)
class MaxTextConfig:
    """One MaxText model as the harness sees it: hashable, and varied with ``replace``.

    ``overrides`` are MaxText config keys (as given on its command line) applied on top
    of ``model_name``'s yml; the remaining fields are the knobs the suite varies.
    ``remat`` picks MaxText's ``remat_policy``: ``"full"`` when set, else ``"minimal"``
    (MaxText always wraps its layers in ``nn.remat``; only the policy changes).
    """

    model_name: str
    overrides: tuple[tuple[str, Any], ...]
    scan_layers: bool
    remat: bool = False
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    quantization: str = ""
    """MaxText's ``quantization`` key for Qwix (``use_qwix_quantization``); empty for float."""
    aqt_mode: str = ""
    """AQT int8 (MaxText's ``quantization: int8``) in this mode: ``train``, ``convert`` or
    ``serve``; empty for none."""
    fp8: bool = False
    """MaxText's ``quantization: fp8``: projections through Flax's FP8 ops (delayed
    scaling), their scales and amax histories ``_overwrite_with_gradient`` values."""
    vocab_tiles: int = 1
    """MaxText's ``num_vocab_tiling``: a training loss computes its logits in this many
    slices (MaxText's ``vocab_tiling_*_loss``)."""
    mesh: Any = None
    """The device mesh (MaxText's axis names) the modules constrain activations on;
    ``None``: the mesh MaxText builds from its config (every device on ``fsdp``)."""

    @classmethod
    def create(cls, model_name: str, overrides: Mapping[str, Any], **fields: Any) -> MaxTextConfig:
        """A config from plain (yaml-like) override values."""
        return cls(model_name, tuple((k, _frozen(v)) for k, v in overrides.items()), **fields)

    def keys(self, backend: str) -> dict[str, Any]:
        """Every MaxText config key this config sets, for ``backend`` ``"linen"`` or ``"nnx"``."""
        keys = {k: _thawed(v) for k, v in self.overrides}
        keys |= dict(_FIXED) | dict(releases.switches(backend))
        keys |= {
            "model_name": self.model_name,
            "scan_layers": self.scan_layers,
            "remat_policy": "full" if self.remat else "minimal",
            "dropout_rate": self.dropout_rate,
            "dtype": jnp.dtype(self.dtype).name,
        }
        if self.quantization:
            keys |= {"quantization": self.quantization, "use_qwix_quantization": True}
        if self.aqt_mode:
            keys |= {"quantization": "int8"}
        if self.fp8:
            keys |= {"quantization": "fp8"}
        if self.vocab_tiles > 1:
            keys |= {"num_vocab_tiling": self.vocab_tiles}
        return keys


_ICI_NAMES: Mapping[str, str] = {"stage": "pipeline"}
"""Mesh axes whose ``ici_<name>_parallelism`` key is named differently."""


def hyperparameters(config: MaxTextConfig, backend: str) -> Any:
    """MaxText's ``HyperParameters`` for ``config`` on ``backend``.

    With a mesh, MaxText's ``ici_<axis>_parallelism`` keys are its axis sizes: MaxText's
    layers read them (the MoE layer's expert and tensor splits), not only the mesh. On a
    mesh whose axes are all explicit, MaxText's ``shard_mode`` is ``explicit`` and its
    ``mesh_axes`` are that mesh's (see :meth:`MaxTextFamily.with_mesh
    <conformance_models.maxtext.family.MaxTextFamily.with_mesh>`). A
    mesh of more devices than this host has (a TPU slice compiled ahead of time) sets
    ``internal_compile_num_devices``, as MaxText's ``train_compile`` does: MaxText then
    counts the slice's devices, not the host's, so its batch and KV caches hold one row
    per chip (``per_device_batch_size`` 1), as the harness's abstract batch does there.
    Configs that set the same keys (the AQT modes differ only in the quantization object
    the adapter passes) share one initialisation.
    """
    keys = config.keys(backend)
    if config.mesh is not None:
        keys |= {
            f"ici_{_ICI_NAMES.get(axis, axis)}_parallelism": n
            for axis, n in config.mesh.shape.items()
        }
        if all_explicit(config.mesh):
            keys |= {"shard_mode": "explicit", "mesh_axes": list(config.mesh.axis_names)}
        if config.mesh.size > jax.device_count():
            keys |= {"internal_compile": True, "internal_compile_num_devices": config.mesh.size}
    return _initialize(tuple(sorted((k, _frozen(v)) for k, v in keys.items())))


def all_explicit(mesh: jax.sharding.Mesh) -> bool:
    """Whether every axis of ``mesh`` is explicit (jax's ``AxisType.Explicit``)."""
    return all(kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)


@functools.cache
def _initialize(keys: tuple[tuple[str, Any], ...]) -> Any:
    """``pyconfig.initialize`` once per set of keys: pyconfig is slow."""
    from maxtext.configs import pyconfig  # optional dependency

    output = os.path.join(tempfile.gettempdir(), "conformance-maxtext")
    return pyconfig.initialize(
        [""], base_output_directory=output, **{k: _thawed(v) for k, v in keys}
    )
