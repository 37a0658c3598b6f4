"""How two train steps are compared when one was computed elsewhere (a recording)."""

import numpy as np

from conformance.checks.kernel import step_disagreement

_LOSS = np.float32(2.0)


def _step(bias: float, bias_grad: float, kernel_grad: float):
    """A step result: the updated bias (state) and the gradients of bias and kernel."""
    grads = {"b": np.array([bias_grad], np.float32), "w": np.array([kernel_grad], np.float32)}
    return {"model/b": np.array([bias], np.float32)}, _LOSS, grads


def test_without_a_spread_any_element_outside_tolerance_fails():
    message = step_disagreement("step", _step(5e-6, 1e-9, 0.5), _step(-8e-6, -1e-9, 0.5))
    assert message is not None
    assert "state/model/b" in message


def test_the_spread_is_computed_only_when_the_steps_disagree():
    def spread():
        raise AssertionError("computed although the steps agree")

    same = _step(0.1, 0.2, 0.5)
    assert step_disagreement("step", same, same, spread=spread) is None


def test_adam_noise_steps_and_elements_within_the_spread_pass():
    recorded = _step(5e-6, 1e-9, 0.50000)
    live = _step(-8e-6, -1e-9, 0.50004)  # Adam's sign step; a sum rounding decides
    partitioned = _step(6e-6, 2e-9, 0.50000)  # the live side with its sums reordered
    assert step_disagreement("step", recorded, live, spread=lambda: partitioned) is None


def test_a_divergence_beyond_the_spread_still_fails_naming_the_leaf():
    recorded = _step(0.1, 0.2, 0.5)
    live = _step(0.1, 0.2, 0.6)
    partitioned = _step(0.1, 0.2, 0.60001)
    message = step_disagreement("step", recorded, live, spread=lambda: partitioned)
    assert message is not None
    assert "grads/w: 1 of 1 elements differ" in message
    assert "grads/b" not in message
    assert "state/model/b" not in message
