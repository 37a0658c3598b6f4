"""Which code a side runs: bridge modules are counted on both backends."""

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from conformance.runtime.provenance import Built, LinenBridges, nnx_built


class Dense(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class LinenWithNnxInside(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nnx.bridge.to_linen(Dense, name="first")(x)
        x = nnx.bridge.to_linen(Dense, name="second")(x)
        return nn.Dense(2, name="own")(x)


def test_a_linen_model_counts_each_tolinen_module_once():
    module = LinenWithNnxInside()
    bridges = LinenBridges()
    with bridges.watching():
        jax.eval_shape(module.init, jax.random.key(0), jnp.ones((1, 2)))
        jax.eval_shape(module.init, jax.random.key(1), jnp.ones((1, 2)))
    built = bridges.built(module)
    assert built.bridged == {"ToLinen": 2}
    assert built.describe().endswith(".LinenWithNnxInside (2 ToLinen)")


def test_an_nnx_model_counts_its_tonnx_modules():
    model = nnx.bridge.ToNNX(nn.Dense(2), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, jnp.ones((1, 2)))
    assert nnx_built(model).bridged == {"ToNNX": 1}
    plain = nnx_built(Dense(nnx.Rngs(0)))
    assert plain == Built(f"{Dense.__module__}.Dense", {})
    assert plain.describe().endswith(".Dense (nothing bridged)")


def test_a_side_that_is_a_bridge_as_a_whole_says_so():
    module = nnx.bridge.to_linen(Dense)
    bridges = LinenBridges()
    with bridges.watching():
        jax.eval_shape(module.init, jax.random.key(0), jnp.ones((1, 2)))
    built = bridges.built(module)
    assert built.whole == "ToLinen"
    assert built.describe().endswith("(1 ToLinen; bridged: the other backend's model)")
