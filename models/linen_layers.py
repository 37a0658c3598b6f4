"""Parameter-owning building blocks shared by the Linen implementations of every family.

Their NNX counterparts live in :mod:`conformance_models.nnx_layers`: each backend names, annotates
and initialises its own parameters, so the two are written separately.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from conformance_models import aqt, common
from conformance_models.common import EMBED_INIT, kernel_init
from conformance_models.config import TransformerConfig


def constrain(x: jax.Array, names: tuple[str, ...], config: TransformerConfig) -> jax.Array:
    """``x`` constrained to the logical ``names`` on ``config.mesh`` (no mesh: ``x``).

    A dimension the mesh axes do not split evenly is left unconstrained
    (:func:`conformance_models.common.divisible_names`).
    """
    names = common.divisible_names(x.shape, names, config)
    return nn.with_logical_constraint(x, names, rules=config.rules, mesh=config.mesh)


class DenseGeneral(nn.Module):
    """Contract the trailing ``len(in_shape)`` input axes with a kernel, plus an optional bias.

    The kernel is ``in_shape + out_shape`` with logical names ``axis_names``; the
    bias (if ``use_bias``) is ``out_shape`` with the trailing names. With ``aqt_mode``
    the contraction runs through AQT int8 (:mod:`conformance_models.aqt`); in ``serve`` mode there
    is no float kernel, only the frozen one in the ``aqt`` collection. With ``fp8`` it runs
    through Flax's ``Fp8DirectDotGeneralOp``, whose scales and amax histories are in the
    ``_overwrite_with_gradient`` collection.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    dtype: Any
    param_dtype: Any
    use_bias: bool = False
    aqt_mode: aqt.AqtMode | None = None
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the projection in ``dtype``."""
        num_in, num_out = len(self.in_shape), len(self.out_shape)
        shape = self.in_shape + self.out_shape
        if self.aqt_mode == "serve":
            kernel = jnp.zeros(shape, self.param_dtype)
        else:
            kernel = self.param(
                "kernel",
                nn.with_logical_partitioning(kernel_init(num_in, num_out), self.axis_names),
                shape,
                self.param_dtype,
            )
        # Flax's promote_dtype rather than astype: quantization libraries (Qwix) intercept
        # it to pass quantized kernels through unchanged.
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        contract = (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in)))
        if self.aqt_mode is not None:
            dot_general = aqt.dot_general(self.aqt_mode, self.axis_names)
            y = dot_general(x, kernel, (contract, ((), ())), None)
        elif self.fp8:
            y = nn.Fp8DirectDotGeneralOp()(x, kernel, (contract, ((), ())))
        else:
            y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axis_names[num_in:]),
                self.out_shape,
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


class Embed(nn.Module):
    """A learned embedding table ``[num_embeddings, features]``."""

    num_embeddings: int
    features: int
    axis_names: tuple[str, str]
    dtype: Any
    param_dtype: Any

    def setup(self) -> None:
        """Create the table."""
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(EMBED_INIT, self.axis_names),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Look up ``ids`` and return the rows in ``dtype``."""
        return jnp.take(self.embedding.astype(self.dtype), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Return ``x @ embedding.T`` in ``dtype`` (tied output logits)."""
        return jnp.einsum("bsd,vd->bsv", x.astype(self.dtype), self.embedding.astype(self.dtype))


class KVCache(nn.Module):
    """Keys and values of past positions for one attention layer (collection ``cache``).

    Holds ``key`` and ``value`` ``[batch, max_seq_len, kv_heads, head_dim]`` and each
    row's next free slot ``index`` ``[batch]``. Called with the layer's new keys and
    values, it returns the keys, values and mask to attend with: in ``forward`` mode
    the inputs themselves; in ``prefill`` and ``decode`` it writes them (see
    :func:`conformance_models.common.prefill_cache` and
    :func:`conformance_models.common.decode_cache`). As in
    Flax's own attention, the variables are created zero on first use and written only
    once they exist, so ``init`` in ``prefill`` mode yields an empty cache.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self, k: jax.Array, v: jax.Array, segment_ids: jax.Array, mode: str
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Return ``(keys, values, mask)`` for ``mode``, writing the cache when serving."""
        common.check_mode(mode)
        if mode == "forward":
            return k, v, common.attention_mask(segment_ids)
        cfg = self.config
        exists = self.has_variable("cache", "key")
        shape = (k.shape[0], cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = nn.with_logical_partitioning(jnp.zeros, common.CACHE_AXES)
        key = self.variable("cache", "key", zeros, shape, cfg.dtype)
        value = self.variable("cache", "value", zeros, shape, cfg.dtype)
        index_init = nn.with_logical_partitioning(jnp.zeros, ("batch",))
        index = self.variable("cache", "index", index_init, (k.shape[0],), jnp.int32)
        written, attended = common.serve_cache(
            mode, (key.value, value.value), index.value, k, v, segment_ids
        )
        if exists:
            key.value, value.value, index.value = written
        return attended


def apply_layers(
    block: type[nn.Module],
    config: TransformerConfig,
    x: jax.Array,
    *args: jax.Array,
    deterministic: bool,
    mode: str,
) -> tuple[jax.Array, jax.Array]:
    """Run ``config.num_layers`` blocks over ``x`` inside the calling compact module.

    Each block is ``block(config)`` called as ``(x, *args, deterministic, mode)`` and
    returns ``(x, x)``. Scanned, the blocks are one ``nn.scan`` named ``layers`` whose
    parameters and cache are stacked on a leading axis named ``layers``; otherwise they
    are ``layers_0``, ``layers_1``, ... Returns the final ``x`` and the block outputs
    stacked ``[num_layers, *x.shape]``.
    """
    block_cls: Any = block
    if config.remat:
        # Counting self, `deterministic` and `mode` (Python values) come after x and args.
        static = (len(args) + 2, len(args) + 3)
        block_cls = nn.remat(block, static_argnums=static, prevent_cse=not config.scan_layers)
    if config.scan_layers:
        stack = nn.scan(
            block_cls,
            variable_axes={"params": 0, "cache": 0, aqt.COLLECTION: 0, OVERWRITE_WITH_GRADIENT: 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * (len(args) + 2),
            length=config.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(config, name="layers")
        return stack(x, *args, deterministic, mode)
    outputs = []
    for i in range(config.num_layers):
        x, _ = block_cls(config, name=f"layers_{i}")(x, *args, deterministic, mode)
        outputs.append(x)
    return x, jnp.stack(outputs)
