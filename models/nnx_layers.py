"""Parameter-owning building blocks shared by the NNX implementations of every family.

Their Linen counterparts live in :mod:`conformance_models.linen_layers`: each backend names,
annotates and initialises its own parameters, so the two are written separately.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from conformance_models import aqt, common
from conformance_models.common import EMBED_INIT, kernel_init
from conformance_models.config import TransformerConfig

LAYERS = "layers"
"""The logical name of a scanned stack's leading axis.

The stack's constructor adds it through ``nnx.transform_metadata``, which works in NNX
graph and tree mode alike: ``nnx.vmap``'s own ``transform_metadata`` argument is ignored
in tree mode (flax 0.12.12), and the stacked parameters would lose the axis name. The
scan over the stack keeps its own argument, which removes the name inside its body in
graph mode; wrapping the body in ``nnx.transform_metadata`` instead clones the block, and
Qwix's PTQ and AQT's convert, which replace its parameters inside the body, would be lost.
In tree mode the body's slices keep the name, which nothing there reads.
"""


def constrain(x: jax.Array, names: tuple[str, ...], config: TransformerConfig) -> jax.Array:
    """``x`` constrained to the logical ``names`` on ``config.mesh`` (no mesh: ``x``).

    A name without a rule leaves its dimension replicated, as in Linen; a dimension the
    mesh axes do not split evenly is left unconstrained
    (:func:`conformance_models.common.divisible_names`).
    """
    if config.mesh is None:
        return x
    spec = nn.logical_to_mesh_axes(common.divisible_names(x.shape, names, config), config.rules)
    if _explicit(x):
        return jax.sharding.reshard(x, NamedSharding(config.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(config.mesh, spec))


def _explicit(x: jax.Array) -> bool:
    """Whether ``x`` is traced on explicit mesh axes (its sharding is part of its type)."""
    return common.explicit_layout(x) is not None


def _spec(x: jax.Array) -> tuple[Any, ...]:
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def like(value: jax.Array, x: jax.Array) -> jax.Array:
    """``value`` laid out as ``x``'s trailing dimensions, to broadcast against ``x``.

    Identity outside explicit mode, where the compiler lays values out.
    """
    if not _explicit(x):
        return value
    return jax.sharding.reshard(value, PartitionSpec(*_spec(x)[x.ndim - value.ndim :]))


def gathered(kernel: jax.Array, x: jax.Array, num_in: int = 0) -> jax.Array:
    """``kernel`` whole over every mesh axis ``x`` is split over, but where they meet.

    FSDP gathers weights, not activations. With ``num_in``, the kernel's first
    ``num_in`` dimensions (contracted with ``x``'s last ``num_in``) are laid out as
    ``x``'s; its other dimensions keep their axes unless ``x`` uses them. Identity
    outside jax's explicit sharding mode, where the compiler gathers.
    """
    if not _explicit(x):
        return kernel
    contracted = _spec(x)[x.ndim - num_in :]
    used = {axis for entry in _spec(x) for axis in common.mesh_axes(entry)}
    rest = _spec(kernel)[num_in:]
    kept = tuple(None if set(common.mesh_axes(e)) & used else e for e in rest)
    return jax.sharding.reshard(kernel, PartitionSpec(*contracted, *kept))


def explicit_dot(x: jax.Array, kernel: jax.Array, num_in: int) -> jax.Array:
    """``x`` contracted with ``kernel`` over ``x``'s last ``num_in`` axes, in explicit mode.

    The kernel is :func:`gathered`; the result keeps ``x``'s leading layout and the
    kernel's output layout, summed over the devices the contraction is split over.
    """
    lead = _spec(x)[: x.ndim - num_in]
    kernel = gathered(kernel, x, num_in)
    out = _spec(kernel)[num_in:]
    contract = (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in)))
    return jax.lax.dot_general(
        x, kernel, (contract, ((), ())), out_sharding=PartitionSpec(*lead, *out)
    )


class DenseGeneral(nnx.Module):
    """Contract the trailing ``len(in_shape)`` input axes with a kernel, plus an optional bias.

    The kernel is ``in_shape + out_shape`` with logical names ``axis_names``; the
    bias (if ``use_bias``) is ``out_shape`` with the trailing names, else ``None``. With
    ``aqt_mode`` the contraction runs through AQT int8 (:mod:`conformance_models.aqt`, bridged from
    Linen); in ``serve`` mode there is no float kernel, only the frozen one. With ``fp8``
    it runs through Flax's Linen ``Fp8DirectDotGeneralOp``, bridged: its scales and amax
    histories are ``_overwrite_with_gradient`` Variables.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axis_names: tuple[str, ...],
        *,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        aqt_mode: aqt.AqtMode | None = None,
        fp8: bool = False,
    ) -> None:
        self.num_in = len(in_shape)
        self.dtype, self.param_dtype = dtype, param_dtype
        self.aqt_mode = aqt_mode
        self.fp8 = fp8
        self.kernel_shape = in_shape + out_shape
        self.kernel: nnx.Param | None
        if aqt_mode == "serve":
            self.kernel = nnx.data(None)
        else:
            init = nnx.with_partitioning(kernel_init(len(in_shape), len(out_shape)), axis_names)
            self.kernel = nnx.Param(init(rngs.params(), self.kernel_shape, param_dtype))
        self.bias: nnx.Param | None
        if use_bias:
            bias_init = nnx.with_partitioning(nnx.initializers.zeros, axis_names[self.num_in :])
            self.bias = nnx.Param(bias_init(rngs.params(), out_shape, param_dtype))
        else:
            self.bias = nnx.data(None)
        example = (
            jnp.zeros((1, *in_shape), dtype),
            jnp.zeros(self.kernel_shape, dtype),
            ((tuple(range(1, 1 + self.num_in)), tuple(range(self.num_in))), ((), ())),
        )
        # Bridged submodules are named as Linen names them, so both backends' paths agree.
        if aqt_mode is not None:
            self.AqtDotGeneral_0 = aqt.BridgedDotGeneral(aqt.dot_general(aqt_mode, axis_names))
            self.AqtDotGeneral_0.lazy_init(*example, None)
        elif fp8:
            self.Fp8DirectDotGeneralOp_0 = aqt.BridgedDotGeneral(nn.Fp8DirectDotGeneralOp())
            self.Fp8DirectDotGeneralOp_0.lazy_init(*example)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the projection in ``dtype``."""
        if self.kernel is None:
            kernel = jnp.zeros(self.kernel_shape, self.param_dtype)
        else:
            kernel = self.kernel[...]
        # Flax's promote_dtype rather than astype: quantization libraries (Qwix) intercept
        # it to pass quantized kernels through unchanged.
        x, kernel = nnx.nn.dtypes.promote_dtype((x, kernel), dtype=self.dtype)
        contract = (tuple(range(x.ndim - self.num_in, x.ndim)), tuple(range(self.num_in)))
        dimension_numbers = (contract, ((), ()))
        if self.aqt_mode is not None:
            mutable = [aqt.COLLECTION] if self.aqt_mode == "convert" else False
            y = self.AqtDotGeneral_0(x, kernel, dimension_numbers, None, mutable=mutable)
        elif self.fp8:
            y = self.Fp8DirectDotGeneralOp_0(x, kernel, dimension_numbers)
        elif _explicit(x):
            y = explicit_dot(x, kernel, self.num_in)
        else:
            y = jax.lax.dot_general(x, kernel, dimension_numbers)
        if self.bias is not None:
            y = y + like(self.bias[...].astype(self.dtype), y)
        return y


class Embed(nnx.Module):
    """A learned embedding table ``[num_embeddings, features]``."""

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        axis_names: tuple[str, str],
        *,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ) -> None:
        self.dtype = dtype
        init = nnx.with_partitioning(EMBED_INIT, axis_names)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Look up ``ids`` and return the rows in ``dtype``.

        On explicit mesh axes the rows are gathered from the whole table, laid out as
        ``ids``; an id out of range gives NaN there as ``jnp.take`` gives it elsewhere.
        """
        table = self.embedding[...].astype(self.dtype)
        if _explicit(ids):
            table = jax.sharding.reshard(table, PartitionSpec())
            rows = PartitionSpec(*_spec(ids), None)
            return table.at[ids].get(mode="fill", out_sharding=rows)
        return jnp.take(table, ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Return ``x @ embedding.T`` in ``dtype`` (tied output logits)."""
        return jnp.einsum(
            "bsd,vd->bsv", x.astype(self.dtype), self.embedding[...].astype(self.dtype)
        )


class KVCache(nnx.Module):
    """Keys and values of past positions for one attention layer, as ``nnx.Cache``.

    Holds ``key`` and ``value`` ``[batch, max_seq_len, kv_heads, head_dim]`` and each
    row's next free slot ``index`` ``[batch]``, all ``None`` until :meth:`init`. Called
    with the layer's new keys and values, it returns the keys, values and mask to
    attend with: in ``forward`` mode the inputs themselves; in ``prefill`` and
    ``decode`` it writes them (see :func:`conformance_models.common.prefill_cache` and
    :func:`conformance_models.common.decode_cache`).
    """

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        self.key: nnx.Cache | None = nnx.data(None)
        self.value: nnx.Cache | None = nnx.data(None)
        self.index: nnx.Cache | None = nnx.data(None)

    def init(self, batch_size: int, stacked: int | None = None) -> None:
        """Create an empty cache for ``batch_size`` rows.

        With ``stacked`` (the layer count of a scanned stack), every variable gets a
        leading axis of that size, logically named ``layers``.
        """
        cfg = self.config
        lead, lead_names = ((stacked,), (LAYERS,)) if stacked is not None else ((), ())
        shape = (*lead, batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        names = (*lead_names, *common.CACHE_AXES)
        self.key = nnx.Cache(jnp.zeros(shape, cfg.dtype), out_sharding=names)
        self.value = nnx.Cache(jnp.zeros(shape, cfg.dtype), out_sharding=names)
        self.index = nnx.Cache(
            jnp.zeros((*lead, batch_size), jnp.int32), out_sharding=(*lead_names, "batch")
        )

    def __call__(
        self, k: jax.Array, v: jax.Array, segment_ids: jax.Array, mode: str
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Return ``(keys, values, mask)`` for ``mode``, writing the cache when serving."""
        common.check_mode(mode)
        if mode == "forward":
            return k, v, common.attention_mask(segment_ids)
        if self.key is None or self.value is None or self.index is None:
            raise ValueError(f"mode {mode!r} needs a cache: call the model's init_cache() first")
        written, attended = common.serve_cache(
            mode, (self.key[...], self.value[...]), self.index[...], k, v, segment_ids
        )
        self.key[...], self.value[...], self.index[...] = written
        return attended


def init_caches(layers: nnx.Module, config: TransformerConfig, batch_size: int) -> None:
    """Create an empty cache in every :class:`KVCache` of the blocks made by :func:`make_layers`."""
    stacked = config.num_layers if config.scan_layers else None
    for _, node in nnx.iter_graph(layers):
        if isinstance(node, KVCache):
            node.init(batch_size, stacked)


def make_layers[B: nnx.Module](
    block: Callable[..., B], config: TransformerConfig, rngs: nnx.Rngs
) -> B | nnx.List[B]:
    """Create ``config.num_layers`` blocks, each ``block(config, rngs=rngs)``.

    Scanned, they are one block whose parameters are stacked on a leading axis named
    ``layers``; otherwise an ``nnx.List`` of blocks.
    """
    if not config.scan_layers:
        return nnx.List([block(config, rngs=rngs) for _ in range(config.num_layers)])

    @nnx.transform_metadata(in_axes=None, out_axes=0, partition=LAYERS)
    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> B:
        return block(config, rngs=rngs)

    return create(rngs)


def apply_layers[B: nnx.Module](
    layers: B | nnx.List[B],
    config: TransformerConfig,
    x: jax.Array,
    *args: jax.Array,
    deterministic: bool,
    mode: str,
) -> tuple[jax.Array, jax.Array]:
    """Run ``x`` through the blocks made by :func:`make_layers`.

    Each block is called as ``block(x, *args, deterministic=deterministic, mode=mode)``
    and returns the new ``x``. Returns the final ``x`` and the block outputs stacked
    ``[num_layers, *x.shape]``.
    """

    def apply_block(block: B, x: jax.Array, *args: jax.Array) -> jax.Array:
        return block(x, *args, deterministic=deterministic, mode=mode)

    if config.remat:
        apply_block = nnx.remat(apply_block, prevent_cse=not config.scan_layers)
    if config.scan_layers:

        def body(x: jax.Array, block: B, *args: jax.Array) -> tuple[jax.Array, jax.Array]:
            x = apply_block(block, x, *args)
            return x, x

        scan = nnx.scan(
            body,
            in_axes=(nnx.Carry, 0) + (None,) * len(args),
            out_axes=(nnx.Carry, 0),
            transform_metadata={nnx.PARTITION_NAME: LAYERS},
        )
        return scan(x, layers, *args)
    outputs = []
    for block in layers:
        x = apply_block(block, x, *args)
        outputs.append(x)
    return x, jnp.stack(outputs)
