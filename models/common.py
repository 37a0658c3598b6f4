"""Pure, parameter-free math shared by the Linen and NNX implementations.

Nothing here owns, names or annotates a parameter: that is written separately for
each backend, because that is where migrations diverge. The initializers are shared
so that both backends draw from the same distributions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("qkv", None),
    ("layers", None),
    ("norm", None),
    ("position", None),
    ("cache_length", None),
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)
"""Logical-axis rules shared by every built-in family, first match wins.

The ``activation_*`` names are the activations' (the parameters' names stand for
parameter axes): rows split over ``data`` and ``fsdp`` as the batch is, the model
dimension whole on each device (FSDP gathers the weights, not the activations), the
MLP's hidden and the vocabulary over ``tensor``.
"""

ACTIVATION_EMBED = ("activation_batch", "activation_length", "activation_embed")
"""The logical names of a ``[batch, seq, d_model]`` activation (the residual stream)."""

ACTIVATION_MLP = ("activation_batch", "activation_length", "activation_mlp")
"""The logical names of an MLP's hidden activation ``[batch, seq, mlp_dim]``."""

ACTIVATION_VOCAB = ("activation_batch", "activation_length", "activation_vocab")
"""The logical names of the logits ``[batch, seq, vocab]``."""


def divisible_names(shape: tuple[int, ...], names: tuple[str, ...], config: Any) -> tuple:
    """``names`` with ``None`` for each dimension its mesh axes do not split evenly.

    Resolved by ``config.rules`` on ``config.mesh``. A micro-batch of 2 rows is then left
    unconstrained on 4 batch shards: on ``data=2,fsdp=2,tensor=2``, XLA:CPU (jaxlib
    0.12.0.1) computed gpt3's position-embedding gradient wrong under such an uneven
    constraint (0.29 for 0.043 at position 0, accumulated over 4 micro-batches).
    """
    if config.mesh is None:
        return names
    sizes = dict(config.mesh.shape)
    spec = nn.logical_to_mesh_axes(names, config.rules)
    kept = []
    for size, name, entry in zip(shape, names, spec, strict=True):
        kept.append(name if size % math.prod(sizes[a] for a in mesh_axes(entry)) == 0 else None)
    return tuple(kept)


def mesh_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one dimension's ``PartitionSpec`` entry names: none, one or several."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


_MASK_VALUE = float(jnp.finfo(jnp.float32).min)

EMBED_INIT = jax.nn.initializers.normal(stddev=0.02)
"""Initializer of every embedding table."""


def kernel_init(num_in: int, num_out: int) -> jax.nn.initializers.Initializer:
    """LeCun-normal init for a kernel whose first ``num_in`` axes are its fan-in."""
    return jax.nn.initializers.variance_scaling(
        1.0,
        "fan_in",
        "truncated_normal",
        in_axis=tuple(range(num_in)),
        out_axis=tuple(range(num_in, num_in + num_out)),
    )


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by rotary position embeddings.

    Uses the "rotate half" layout: feature ``i`` is paired with feature
    ``i + head_dim // 2``. Angles and the rotation are computed in float32 and the
    result is cast back to ``x.dtype``. ``positions`` is ``[batch, seq]``.
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim))
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [b, s, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Boolean mask ``[batch, 1, q, k]``: causal, same segment, and key not padding.

    ``segment_ids`` is ``[batch, seq]`` with 0 marking padding.
    """
    seq = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=jnp.bool_))
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    key_valid = (segment_ids != 0)[:, None, :]
    return (causal[None] & same_segment & key_valid)[:, None]


def explicit_layout(x: jax.Array) -> Any:
    """``x``'s sharding if it is traced on a mesh with explicit axes, else ``None``.

    What an operation whose result jax's explicit sharding mode cannot infer is told to
    lay its result out as; ``None`` leaves it to the compiler, as outside that mode.
    """
    sharding = jax.typeof(x).sharding
    return sharding if jax.sharding.AxisType.Explicit in sharding.mesh.axis_types else None


def _repeat_heads(x: jax.Array, times: int) -> jax.Array:
    """Each head of ``[batch, seq, heads, head_dim]`` ``x`` repeated ``times`` in place.

    In jax's explicit sharding mode, laid out as ``x``: each device repeats its own heads.
    """
    return jnp.repeat(x, times, axis=2, out_sharding=explicit_layout(x))


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: Any
) -> jax.Array:
    """Scaled dot-product attention with grouped-query support.

    ``q`` is ``[batch, seq, heads, head_dim]``; ``k`` and ``v`` are ``[batch, seq,
    kv_heads, head_dim]`` with ``heads`` a multiple of ``kv_heads`` (each kv head is
    repeated for its group of query heads). ``mask`` is boolean ``[batch, 1, q, k]``.
    Matmuls run in ``dtype``; the softmax runs in float32. A fully masked query row
    (a padding token) attends uniformly instead of producing NaN. Returns ``[batch,
    seq, heads, head_dim]`` in ``dtype``.
    """
    heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if heads != kv_heads:
        k, v = _repeat_heads(k, heads // kv_heads), _repeat_heads(v, heads // kv_heads)
    q = q.astype(dtype) * jnp.asarray(head_dim**-0.5, dtype)
    k, v = k.astype(dtype), v.astype(dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    logits = jnp.where(mask, logits, _MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def tiled_token_loss(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    tiles: int,
) -> jax.Array:
    """Weighted next-token cross entropy of ``head(hidden)``, ``tiles`` slices at a time.

    ``hidden`` is ``[batch, seq, d_model]``; its ``batch x seq`` positions are cut into
    ``tiles`` equal slices, each given to ``head`` as one row (``[1, n, d_model]``), and
    each slice's logits are reduced to a float32 loss before the next slice's are
    computed. Returns the sum over slices of ``weights x cross entropy``: the loss of
    the untiled logits, summed.
    """
    positions = targets.size
    if positions % tiles:
        raise ValueError(f"{positions} positions do not split into {tiles} tiles")
    hidden = hidden.reshape(tiles, 1, positions // tiles, hidden.shape[-1])
    targets, weights = targets.reshape(tiles, 1, -1), weights.reshape(tiles, 1, -1)
    total = jnp.zeros((), jnp.float32)
    for tile in range(tiles):
        logits = head(hidden[tile]).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets[tile])
        total += jnp.sum(losses * weights[tile])
    return total


MODES = ("forward", "prefill", "decode")
"""Call-time modes of every decoder: a full forward, a prompt prefill, one decode step."""

CACHE_AXES = ("batch", "cache_length", "kv_heads", "head_dim")
"""Logical axis names of a cached key or value ``[batch, max_seq_len, kv_heads, head_dim]``."""


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


def prefill_cache(
    cached: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array, segment_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Write a right-padded prompt's keys and values into slots ``[0, prompt_len)``.

    Returns the new cached key and value, each row's next free slot (its number of real
    tokens) and the prompt's own attention mask: prefill attends exactly like a forward.
    """
    cached_k, cached_v = cached
    if k.shape[1] > cached_k.shape[1]:
        raise ValueError(f"prompt of {k.shape[1]} tokens exceeds the cache's {cached_k.shape[1]}")
    new_k = jax.lax.dynamic_update_slice(cached_k, k.astype(cached_k.dtype), (0, 0, 0, 0))
    new_v = jax.lax.dynamic_update_slice(cached_v, v.astype(cached_v.dtype), (0, 0, 0, 0))
    index = jnp.sum(segment_ids != 0, axis=-1, dtype=jnp.int32)
    return new_k, new_v, index, attention_mask(segment_ids)


def decode_cache(
    cached: tuple[jax.Array, jax.Array], index: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Write one token's key and value at each row's own slot ``index[row]``.

    ``k`` and ``v`` are ``[batch, 1, kv_heads, head_dim]``. Returns the new cached key
    and value, the advanced index and the mask ``[batch, 1, 1, max_seq_len]`` that lets
    the token attend to every slot up to and including its own.
    """
    cached_k, cached_v = cached

    def write(cache: jax.Array, new: jax.Array) -> jax.Array:
        row_write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, 0))
        return row_write(cache, new.astype(cache.dtype), index)

    slots = jnp.arange(cached_k.shape[1], dtype=jnp.int32)
    mask = (slots[None, :] <= index[:, None])[:, None, None, :]
    return write(cached_k, k), write(cached_v, v), index + 1, mask


def serve_cache(
    mode: str,
    cached: tuple[jax.Array, jax.Array],
    index: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """One ``prefill`` or ``decode`` call against a layer's cache.

    Returns ``((key, value, index), (keys, values, mask))``: the new cache contents and
    what the layer attends with (prefill: the prompt itself; decode: the whole cache).
    """
    if mode == "prefill":
        new_k, new_v, new_index, mask = prefill_cache(cached, k, v, segment_ids)
        return (new_k, new_v, new_index), (k, v, mask)
    new_k, new_v, new_index, mask = decode_cache(cached, index, k, v)
    return (new_k, new_v, new_index), (new_k, new_v, mask)
