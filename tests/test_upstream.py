"""Known upstream bugs the harness works around, pinned so a fix is noticed.

Each test asserts the correct behaviour and is a strict xfail while the bug exists: when
an upgrade fixes it, the test XPASSes, fails the run, and the workaround can go.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


@pytest.mark.xfail(
    jax.default_backend() == "cpu",
    strict=True,
    reason="XLA SPMD on CPU (jaxlib 0.12.0.1): the gradient of a gather over a slice of a "
    "batch sharded over ('data', 'fsdp') is wrong; conformance.training.accumulate "
    "constrains micro-batches to a replicated sharding to avoid it",
)
def test_gather_gradient_over_sliced_sharded_batch():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rng = np.random.default_rng(0)
    table = jax.device_put(
        jnp.asarray(rng.normal(size=(32, 64)), jnp.float32), NamedSharding(mesh, P(None, "fsdp"))
    )
    index = jax.device_put(
        jnp.broadcast_to(jnp.arange(32), (8, 32)), NamedSharding(mesh, P(("data", "fsdp")))
    )
    weights = jnp.asarray(rng.normal(size=(8, 32, 64)), jnp.float32)

    def loss(table, index, weights):
        return jnp.sum(jnp.take(table, index, axis=0) * weights)

    def accumulated(table, index, weights):
        grads = [jax.grad(loss)(table, index[i : i + 2], weights[i : i + 2]) for i in (0, 2, 4, 6)]
        return sum(grads[1:], grads[0])

    expected = jax.grad(loss)(np.asarray(table), np.asarray(index), weights)
    np.testing.assert_allclose(jax.jit(accumulated)(table, index, weights), expected, atol=1e-4)
