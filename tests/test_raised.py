"""An exception inside a side is a report: which side, which call, which parameter, and
whether the other backend fails alike. An exception outside every side propagates."""

import dataclasses

import jax
import pytest
from flax import linen as nn
from flax import nnx

from conformance import families
from conformance.checks import registry
from conformance.core.failure import CheckFailure
from conformance.core.sharding import parse_mesh
from conformance.runtime.case import Case

QUERY = ("embed", "heads", "head_dim")


def _case(quant: str | None = None) -> Case:
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    case = Case.of(families.get("llama"), "tiny", mesh=mesh, devices=mesh.devices())
    return case.quantized(quant)


def _two_names(partition):
    """``partition`` that annotates the 3-D query kernel with only two logical names."""

    def partitioned(init, names, *args, **kwargs):
        return partition(init, names[:2] if tuple(names) == QUERY else names, *args, **kwargs)

    return partitioned


def test_the_same_library_error_on_both_backends_is_reported_as_one(monkeypatch):
    monkeypatch.setattr(nn, "with_logical_partitioning", _two_names(nn.with_logical_partitioning))
    monkeypatch.setattr(nnx, "with_partitioning", _two_names(nnx.with_partitioning))
    with pytest.raises(CheckFailure) as caught:
        registry.get("quant_forward")(_case("ptq_int8"))
    report = str(caught.value)
    assert report.startswith("llama quant_forward: Linen raised AssertionError while building")
    assert "shape=(64, 4, 16) spec=('embed', 'heads')" in report
    assert "raised at qwix/_src/utils/flax_util.py" in report
    assert "called from llama's own code (conformance_models) at models/linen_layers.py" in report
    assert "the parameters it names: layers_0/attn/q/kernel: shape (64, 4, 16)" in report
    assert "layers_1/attn/q/kernel" in report
    assert "NNX fails alike (NnxRunner.build): the same error on both backends" in report
    assert "not a Linen/NNX divergence" in report
    assert len(report.splitlines()) < 10, report


def test_an_error_outside_every_side_propagates_unchanged():
    def broken(case):
        raise KeyError("the harness's own bug")

    check = dataclasses.replace(registry.get("forward"), run=broken)
    with pytest.raises(KeyError, match="the harness's own bug"):
        check(_case())


def _refuse_steps(monkeypatch, refusal, needle=""):
    """XLA raises ``refusal`` for every train step program whose text holds ``needle``."""
    from jax._src import compiler

    compile_fn = compiler.compile_or_get_cached

    def refusing(backend, computation, *args, **kwargs):
        name = str(computation.operation.attributes["sym_name"])
        if name == '"jit_step"' and needle in str(computation):
            raise jax.errors.JaxRuntimeError(refusal)
        return compile_fn(backend, computation, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", refusing)
    jax.clear_caches()


REFUSAL = "INTERNAL: No supported config found for HLO: %gemm_fusion_dot.75 = s32[8,256,64]"


def test_a_train_step_xla_cannot_compile_is_the_sides_report(monkeypatch):
    """On one H100 (jaxlib 0.11.2, XLA's deterministic GPU ops on), XLA found no GEMM config
    for AQT's int8 batched backward dot: the compile error is raised outside every side's
    own methods, by the harness running the side's jitted step, and must still be a report."""
    _refuse_steps(monkeypatch, REFUSAL)
    with pytest.raises(CheckFailure) as caught:
        registry.get("train_step")(_case())
    jax.clear_caches()
    report = str(caught.value)
    assert report.startswith(
        "llama train_step: Linen raised JaxRuntimeError while running a train step "
        "(Training.advance)"
    ), report
    assert REFUSAL in report
    assert "NNX fails alike (Training.advance): the same error on both backends" in report


def test_the_other_side_is_probed_in_the_case_that_raised(monkeypatch):
    """The H100's refusal hit only the AQT train step (its int8 dots): probing NNX's float
    train step instead called it 'only Linen fails ... a Linen/NNX divergence'."""
    _refuse_steps(monkeypatch, REFUSAL, needle="xi8>")
    with pytest.raises(CheckFailure) as caught:
        registry.get("aqt_train_step")(_case())
    jax.clear_caches()
    report = str(caught.value)
    assert "Linen raised JaxRuntimeError while running a train step" in report, report
    assert "NNX fails alike (Training.advance): the same error on both backends" in report


class AdapterBug(families.get("llama").__class__):
    """A family whose own NNX adapter raises: the report must say the error is the zoo's."""

    def nnx_module(self, config, rngs):
        raise ValueError("the adapter forgot a layer")


def test_an_error_in_the_familys_own_code_is_named_as_such():
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    case = Case.of(AdapterBug(), "tiny", mesh=mesh, devices=mesh.devices())
    with pytest.raises(CheckFailure) as caught:
        registry.get("forward")(case)
    report = str(caught.value)
    assert "NNX raised ValueError while building the model" in report, report
    package = AdapterBug.__module__.split(".")[0]
    assert f"raised in llama's own code ({package}), not the harness's" in report, report
    assert "only NNX fails: Linen gets through building the model" in report, report
