"""Each distinct program is compiled once while it lives, and again only after a release."""

import jax
import jax.numpy as jnp
import numpy as np

from conformance.core import programs, scope
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


def _over_the_mesh(x):
    """``x`` split over every device (a mesh program's input)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))


def _compiles_after_a_release(x, keep_programs=False):
    """How often the second of two twin jits compiles ``x`` when a scope ended between."""
    first, second = _twin_jits()
    with Scope(keep_programs=keep_programs):
        first(x)
    compiled = programs.COUNTS.compiled
    with Scope():
        second(x)
    return programs.COUNTS.compiled - compiled


def test_a_release_drops_the_programs_of_a_mesh():
    assert programs.install()
    assert jax.device_count() > 1
    assert _compiles_after_a_release(_over_the_mesh(jnp.arange(16.0))) == 1


def test_a_scope_that_keeps_programs_keeps_those_of_a_mesh_within_the_mapping_budget():
    assert programs.install()
    assert _compiles_after_a_release(_over_the_mesh(jnp.arange(24.0)), keep_programs=True) == 0


def test_past_the_mapping_budget_a_scope_that_keeps_programs_drops_them(monkeypatch):
    assert programs.install()
    monkeypatch.setattr(scope, "mapping_budget", lambda: 0)
    mesh_input = _over_the_mesh(jnp.arange(32.0))
    assert _compiles_after_a_release(mesh_input, keep_programs=True) == 1


def test_a_release_keeps_one_device_programs_within_the_mapping_budget():
    assert programs.install()
    assert _compiles_after_a_release(jnp.arange(5.0)) == 0


def test_past_the_mapping_budget_a_release_drops_one_device_programs_too(monkeypatch):
    assert programs.install()
    monkeypatch.setattr(scope, "mapping_budget", lambda: 0)
    assert _compiles_after_a_release(jnp.arange(6.0)) == 1


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


def test_counts_of_two_processes_add_up_and_share_their_distinct_programs():
    first = programs.Counts(compiled=3, reused=1, distinct={"a", "b", "c"})
    second = programs.Counts(compiled=2, reused=4, distinct={"b", "d"})
    first.add(second.as_data())
    assert (first.compiled, first.reused, first.distinct) == (5, 5, {"a", "b", "c", "d"})
