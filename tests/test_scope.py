"""Scopes own what scoped factories build, and releasing one frees compiled programs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from conformance.core.scope import Scope, kept, mapping_count, scoped

BUILT = []


@scoped
def thing(name):
    BUILT.append(name)
    return object()


def test_a_scope_memoises_until_it_is_left():
    with Scope() as outer:
        first = thing("a")
        assert thing("a") is first
        assert len(outer) == 1
        with Scope():
            assert thing("a") is not first
        assert thing("a") is first
    with Scope():
        assert thing("a") is not first


@kept
def result(name):
    BUILT.append(name)
    return object()


@scoped
def sized(name, size=1):
    return object()


def test_calls_spelling_out_a_default_share_one_result():
    with Scope() as scope:
        assert sized("a") is sized("a", 1) is sized("a", size=1)
        assert sized("a", 2) is not sized("a")
        assert len(scope) == 2


def test_kept_results_outlive_a_release_that_keeps_them():
    with Scope() as scope:
        value, built = result("r"), thing("t")
        scope.release(keep_results=True)
        assert result("r") is value
        assert thing("t") is not built
        scope.release()
        assert result("r") is not value


@scoped
def program(index, offset):
    return jax.jit(lambda a: jnp.tanh(a @ a.T * (index + offset)).sum(0))


def _compile(count, offset):
    """Compile and run ``count`` programs, each held by the active scope."""
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, PartitionSpec("fsdp")))
    for index in range(count):
        program(index, offset)(x).block_until_ready()
    return mapping_count()


@pytest.mark.skipif(mapping_count() is None, reason="needs /proc/self/maps (Linux)")
def test_leaving_a_scope_lets_later_programs_reuse_freed_code_memory():
    peaks = []
    for offset in (100.0, 200.0, 300.0):
        with Scope():
            peaks.append(_compile(40, offset))
    with Scope():
        _compile(40, 400.0)
        held_twice = _compile(40, 500.0)
    assert max(peaks) - min(peaks) < 40, f"released programs still grow the mappings: {peaks}"
    assert held_twice > max(peaks) + 100, "programs held together should map more code"
