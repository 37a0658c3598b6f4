"""Process set-up: the settings every run compiles its programs under, and what they mean
for a report."""

import itertools

import jax
import numpy as np
import pytest

from conformance.checks import registry
from conformance.core.environment import nondeterminism, set_matmul_precision
from conformance.core.failure import CheckFailure
from conformance.core.scope import Scope
from conformance.core.seams import planted
from conformance.core.sharding import parse_mesh
from conformance.runtime.case import Case
from conformance.runtime.training import nnx_training_forward
from conformance_models.llama.family import LlamaFamily


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


@pytest.mark.parametrize(
    ("backend", "flags", "named"),
    [("gpu", "", True), ("gpu", "--xla_gpu_deterministic_ops=true", False), ("cpu", "", False)],
)
def test_a_gpu_without_deterministic_ops_is_named_as_a_cause(monkeypatch, backend, flags, named):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setenv("XLA_FLAGS", flags)
    note = nondeterminism()
    assert (note is not None) == named
    if named:
        assert "XLA_FLAGS=--xla_gpu_deterministic_ops=true" in note


def test_a_resume_that_rounds_apart_on_a_gpu_says_why(monkeypatch, tmp_path):
    """A forward whose scale changes with every run (a host callback's counter) stands in
    for a GPU's atomic reductions: the resumed step differs, and the report names the flag."""
    counter = itertools.count()

    def drifting(model, batch, train_kwargs):
        logits, sown = nnx_training_forward(model, batch, train_kwargs)
        scale = jax.pure_callback(
            lambda: np.float32(1 + 1e-3 * next(counter)), jax.ShapeDtypeStruct((), np.float32)
        )
        return logits * scale, sown

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    mesh = parse_mesh("fsdp=2")
    case = Case.of(LlamaFamily(), "tiny", mesh=mesh, devices=mesh.devices())
    with Scope(), planted(nnx_training_forward=drifting), pytest.raises(CheckFailure) as caught:
        registry.get("resume")(case, backend="nnx", workdir=tmp_path)
    text = str(caught.value)
    assert "NNX step 3 of 4" in text, text
    assert text.endswith("to tell that from a real difference"), text
