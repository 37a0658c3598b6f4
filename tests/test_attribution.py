"""Attribution: which side of a failed comparison moves when partitioned, in words."""

import numpy as np
import pytest

from conformance.core.sharding import one_device, parse_mesh
from conformance.runtime.diagnose.attribution import attribute, attribution_text

MESH = parse_mesh("data=2,fsdp=2,tensor=2")
GOOD = {"grads/w": np.ones(4, np.float32)}
OFF = {"grads/w": np.array([1, 1, 1, 2], np.float32)}


def test_one_device_keeps_every_axis_name_at_size_one():
    assert one_device(MESH).id == "data1-fsdp1-tensor1"
    assert one_device(parse_mesh("fsdp=8")) == one_device(MESH)
    assert one_device(parse_mesh("expert=4")).id == "data1-fsdp1-tensor1-expert1"


@pytest.mark.parametrize(
    ("on_mesh", "on_one", "verdict"),
    [
        (
            (GOOD, OFF),
            (GOOD, GOOD),
            "verdict: a partitioning problem, not a Linen/NNX divergence: NNX computes "
            "differently when partitioned on mesh data2-fsdp2-tensor2",
        ),
        (
            (GOOD, OFF),
            (GOOD, OFF),
            "verdict: a Linen/NNX divergence: it shows on one device too, and partitioning "
            "changes neither side",
        ),
        (
            (OFF, GOOD),
            (GOOD, OFF),
            "verdict: a Linen/NNX divergence (it shows on one device too); partitioning on "
            "mesh data2-fsdp2-tensor2 also changes Linen and NNX",
        ),
    ],
)
def test_the_verdict_names_the_side_that_moved(on_mesh, on_one, verdict):
    text = attribute(MESH, ("Linen", "NNX"), on_mesh, on_one).describe()
    assert text.endswith(verdict), text
    assert "grads/w by 1.000e+00" in text


def test_a_gap_within_tolerance_on_each_leg_is_rounding():
    near = {"grads/w": np.full(4, 1 + 8e-6, np.float32)}
    far = {"grads/w": np.full(4, 1 + 1.6e-5, np.float32)}
    text = attribute(MESH, ("a", "b"), (GOOD, far), (near, near)).describe()
    assert "rounding at the tolerance's edge" in text, text


def test_a_failing_one_device_run_is_reported_not_raised():
    def broken():
        raise RuntimeError("no device")

    text = attribution_text(MESH, ("Linen", "NNX"), (GOOD, OFF), broken)
    assert text == (
        "sharding attribution unavailable: the one-device run failed (RuntimeError: no device)"
    )


@pytest.mark.parametrize(
    ("on_one", "verdict"),
    [
        ((OFF, OFF), "the two agree on one device and differ only when partitioned"),
        ((OFF, GOOD), "verdict: a Linen/NNX divergence: it shows on one device too"),
    ],
)
def test_a_quantized_side_may_move_and_only_the_one_device_gap_decides(on_one, verdict):
    text = attribute(MESH, ("Linen", "NNX"), (GOOD, OFF), on_one, quantized=True).describe()
    assert "Linen on mesh data2-fsdp2-tensor2 differs from itself on one device" in text
    assert "moves values across quantization steps" in text
    assert verdict in text, text
