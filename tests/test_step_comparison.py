"""How two train steps are compared: recorded elsewhere, or in bfloat16 compute."""

import jax.numpy as jnp
import numpy as np

from conformance.checks.kernel import step_disagreement, twin_verdict
from conformance.core.numerics import tolerance_for

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


BF16 = tolerance_for(jnp.bfloat16)


def _grads(bias_grad: float, kernel_grad: tuple[float, float]):
    """A bfloat16-compute step: the bias after one Adam step (it moves by the learning
    rate in its gradient's direction) and the gradients of the bias and a kernel."""
    grads = {"b": np.array([bias_grad], np.float32), "w": np.array(kernel_grad, np.float32)}
    return {"model/b": np.array([np.sign(bias_grad) * 1e-3], np.float32)}, _LOSS, grads


def test_a_bfloat16_pair_within_rounding_of_its_float32_twin_passes():
    first, twin = _grads(0.5, (1.0, 2.0)), _grads(0.5, (1.05, 2.0))
    verdict = twin_verdict((first, _grads(0.5, (1.03, 2.0))), (twin, twin), BF16)
    assert verdict.accepted, verdict.text
    assert "grads/w" in verdict.text


def test_a_bfloat16_pair_farther_than_rounding_fails_naming_the_leaf():
    first, twin = _grads(0.5, (1.0, 2.0)), _grads(0.5, (1.05, 2.0))
    verdict = twin_verdict((first, _grads(0.5, (1.5, 2.0))), (twin, twin), BF16)
    assert not verdict.accepted
    assert "grads/w: " in verdict.text
    assert "farther than rounding moves it" in verdict.text


def test_a_bfloat16_pair_whose_float32_twins_disagree_fails():
    first, twin = _grads(0.5, (1.0, 2.0)), _grads(0.5, (1.05, 2.0))
    twins = (twin, _grads(0.5, (1.5, 2.0)))
    verdict = twin_verdict((first, _grads(0.5, (1.03, 2.0))), twins, BF16)
    assert not verdict.accepted
    assert "the float32 steps disagree too" in verdict.text


def test_adam_steps_a_gradient_sign_decides_are_not_compared_in_bfloat16():
    """The bias gradients (1e-4 and -2e-5) are within rounding of each other, against
    the first's own distance from float32 (3e-4 there), so the sign of the second is
    noise: the biases Adam moved apart (1e-3 and -1e-3) are not a divergence, though
    the first bias equals its float32 twin's."""
    first, second = _grads(1e-4, (1.0, 2.0)), _grads(-2e-5, (1.0, 2.0))
    twin = _grads(3e-4, (1.0, 2.0))
    verdict = twin_verdict((first, second), (twin, twin), BF16)
    assert verdict.accepted, verdict.text
    assert "state/model/b" not in verdict.text
