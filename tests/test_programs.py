"""Each distinct program is compiled once while it lives, and again only after a release."""

import jax
import jax.numpy as jnp
import numpy as np

from conformance.core import programs
from conformance.core.scope import Scope


def _twin_jits():
    """Two jit objects of the same computation (as two runners of equal configs are)."""
    return jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0), jax.jit(lambda y: jnp.sin(y) * 3.0 + 1.0)


def test_the_same_program_from_two_jit_objects_compiles_once_in_a_scope():
    assert programs.install()
    first, second = _twin_jits()
    x = jnp.arange(7.0)
    with Scope():
        compiled, reused = programs.COUNTS.compiled, programs.COUNTS.reused
        a, b = first(x), second(x)
        assert programs.COUNTS.compiled - compiled == 1
        assert programs.COUNTS.reused - reused == 1
    np.testing.assert_array_equal(a, b)


def test_a_release_drops_the_live_executables():
    assert programs.install()
    first, second = _twin_jits()
    x = jnp.arange(5.0)
    with Scope():
        first(x)
    compiled = programs.COUNTS.compiled
    with Scope():
        second(x)
    assert programs.COUNTS.compiled - compiled == 1, "compiled again after the release"


def test_a_program_with_a_host_callback_is_never_shared():
    assert programs.install()
    seen = []

    def traced(x):
        jax.debug.callback(seen.append, x)
        return x + 1

    x = jnp.ones(3)
    with Scope():
        jax.jit(traced)(x)
        compiled, reused = programs.COUNTS.compiled, programs.COUNTS.reused
        jax.jit(lambda x: traced(x))(x)
        jax.effects_barrier()
        assert programs.COUNTS.compiled - compiled == 1
        assert programs.COUNTS.reused == reused
    assert len(seen) == 2


def test_the_summary_counts_distinct_programs():
    assert programs.install()
    assert "programs compiled" in programs.summary()
    assert "distinct" in programs.summary()
