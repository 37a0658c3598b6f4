"""The MaxText families' mode findings, reduced to flax and JAX alone, upstream-ready.

Each finding a MaxText family declares on a mode pair (``graph-vs-tree``,
``auto-vs-explicit``) fails in MaxText's own code, which these tests do not import. Each
is reduced here to the few lines of flax or JAX that fail the same way, with the same
words, and to the rewrite that makes them pass: the first test of a pair shows the
failure with the pinned libraries, the second that the rewrite works. When an upgrade
changes either (flax accepting shared references in tree mode, JAX resharding for the
caller), a test fails and the finding's reason is to be revisited.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

BATCH = P(("data", "fsdp"), None, "tensor")
"""MaxText's residual stream on data=2,fsdp=2,tensor=2: batch over data and fsdp, the
embedding over tensor."""


@pytest.fixture
def explicit_mesh():
    """The 3-axis mesh of the harness, every axis explicit, set as the mesh in context."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    with jax.set_mesh(mesh):
        yield mesh


class _Attention(nnx.Module):
    """Keeps the ``nnx.Rngs`` it is given, as MaxText 0.2.5's ``layers/attentions.py`` does."""

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs
        self.query = nnx.Linear(4, 4, rngs=rngs)


class _Layer(nnx.Module):
    """Keeps its ``nnx.Rngs`` and hands them on, as 0.2.5's decoder layers do."""

    def __init__(self, rngs: nnx.Rngs, *, fork: bool):
        self.rngs = rngs
        self.attention = _Attention(rngs.fork() if fork else rngs)


def _built(fork: bool, graph: bool = False) -> set[str]:
    """The state paths of a ``_Layer`` built in tree mode, or in graph mode."""
    with nnx.set_graph_mode(graph), nnx.set_graph_updates(graph):
        _, state = nnx.split(_Layer(nnx.Rngs(0), fork=fork))
    return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}


def test_a_module_keeping_the_rngs_it_hands_on_cannot_build_in_tree_mode():
    """maxtext-gpt3, -gemma2, -deepseek3 ``tree_mode``: ``Rngs at decoder/layers/rngs and
    decoder/layers/self_attention/rngs``. In graph mode the two paths share one object."""
    with pytest.raises(ValueError, match=r"(?s)Duplicate RngCount.*\.attention\.rngs\.default"):
        _built(fork=False)
    paths = _built(fork=False, graph=True)
    assert "attention/rngs/default/count" in paths  # one object, kept at its first path
    assert "rngs/default/count" not in paths


def test_forked_rngs_build_in_tree_mode():
    """The rewrite: the sub-module gets streams of its own (``rngs.fork()``)."""
    assert {"rngs/default/count", "attention/rngs/default/count"} <= _built(fork=True)


def _kv_update(cache: jax.Array, update: jax.Array, resharded: bool) -> jax.Array:
    if resharded:
        update = jax.sharding.reshard(update, jax.typeof(cache).sharding.spec)
    return jax.lax.dynamic_update_slice(cache, update, (0, 0, 0, 0))


def test_a_kv_cache_split_over_tensor_takes_no_whole_update_on_explicit_axes(explicit_mesh):
    """maxtext 0.2.5 ``decode`` (``inference/kvcache.py``, ``update_ar_key_value``) on the
    ``auto-vs-explicit`` pair: the cache's heads split over tensor, the new token's whole."""
    cache = jax.device_put(jnp.zeros((8, 2, 8, 16)), P(None, "tensor"))
    update = jnp.ones((1, 2, 8, 16))
    shown = re.escape("dynamic_update_slice operand sharding must be equal to update sharding")
    with pytest.raises(Exception, match=shown) as raised:
        jax.jit(_kv_update, static_argnums=2)(cache, update, False)
    assert type(raised.value).__name__ == "ShardingTypeError"  # jax keeps it private


def test_a_kv_update_resharded_as_the_cache_writes_it(explicit_mesh):
    """The rewrite: the update is resharded to the cache's layout first."""
    cache = jax.device_put(jnp.zeros((8, 2, 8, 16)), P(None, "tensor"))
    written = jax.jit(_kv_update, static_argnums=2)(cache, jnp.ones((1, 2, 8, 16)), True)
    assert jax.typeof(written).sharding.spec == P(None, "tensor", None, None)
    assert float(written[0].sum()) == 2 * 8 * 16


def _layers(x: jax.Array, kept: bool) -> jax.Array:
    """Two scanned layers whose output projection lays the residual stream out whole."""
    kernel = jnp.full((64, 64), 0.01)

    def layer(carry, _):
        out = jnp.einsum("bsd,de->bse", carry, kernel, out_sharding=P(("data", "fsdp"), None))
        return jax.sharding.reshard(jnp.tanh(out), BATCH) if kept else jnp.tanh(out), None

    return jax.lax.scan(layer, x, length=2)[0]


def test_a_layer_scan_whose_layer_drops_the_carrys_layout_does_not_trace(explicit_mesh):
    """maxtext 0.2.5 scanned layers on explicit axes (``layers/nnx_decoders.py``,
    ``_apply_layers_sequentially``): a layer returns the residual stream without the
    layout it was given."""
    x = jax.device_put(jnp.ones((8, 16, 64)), BATCH)
    shown = "scan body function carry input and carry output must have equal types"
    with pytest.raises(TypeError, match=shown):
        jax.jit(_layers, static_argnums=1)(x, False)


def test_a_layer_that_keeps_the_carrys_layout_scans(explicit_mesh):
    """The rewrite: the layer gives the residual stream back in the layout it came in."""
    x = jax.device_put(jnp.ones((8, 16, 64)), BATCH)
    out = jax.jit(_layers, static_argnums=1)(x, True)
    assert jax.typeof(out).sharding.spec == BATCH


def _rms_scaled(x: jax.Array, scale: jax.Array, aligned: bool) -> jax.Array:
    if aligned:
        scale = jax.sharding.reshard(scale, P(jax.typeof(x).sharding.spec[-1]))
    return jnp.einsum("...k,k->...k", x, scale)


def test_a_norm_scale_whole_against_activations_split_over_tensor_fails(explicit_mesh):
    """maxtext-deepseek3 on explicit axes (``layers/normalizations.py:129``, built without
    ``shard_mode`` by ``models/deepseek.py``): the scale is not aligned with the axis."""
    x = jax.device_put(jnp.ones((8, 16, 64)), BATCH)
    shown = "dot_general requires lhs batch dimensions and rhs batch dimensions to have the same"
    with pytest.raises(Exception, match=shown) as raised:
        jax.jit(_rms_scaled, static_argnums=2)(x, jnp.ones(64), False)
    assert type(raised.value).__name__ == "ShardingTypeError"


def test_a_norm_scale_aligned_with_the_normalised_axis_applies(explicit_mesh):
    """The rewrite: the scale is resharded as the normalised axis, as ``shard_mode`` does."""
    x = jax.device_put(jnp.ones((8, 16, 64)), BATCH)
    out = jax.jit(_rms_scaled, static_argnums=2)(x, jnp.full(64, 2.0), True)
    np.testing.assert_array_equal(np.asarray(out), 2.0)
    assert jax.typeof(out).sharding.spec == BATCH
