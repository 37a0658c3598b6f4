"""Process set-up: the settings every run compiles its programs under."""

import jax
import pytest

from conformance.core.environment import set_matmul_precision


@pytest.fixture
def precision():
    """Restores jax's default matmul precision after the test."""
    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.usefixtures("precision")
def test_float32_matmuls_run_at_full_precision_by_default(monkeypatch):
    monkeypatch.delenv("JAX_DEFAULT_MATMUL_PRECISION", raising=False)
    jax.config.update("jax_default_matmul_precision", None)
    assert set_matmul_precision() == "highest"
    assert jax.config.jax_default_matmul_precision == "highest"


@pytest.mark.usefixtures("precision")
def test_a_precision_the_user_chose_wins(monkeypatch):
    monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "tensorfloat32")
    jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    assert set_matmul_precision() == "tensorfloat32"
