"""The harness's own forwards outside ``nnx.capture`` do not warn from a family's code."""

import warnings

import jax.numpy as jnp
import pytest
from flax import nnx

from conformance.runtime.sowing import outside_capture


class Sows(nnx.Module):
    def __call__(self, x):
        self.sow(nnx.Intermediate, "hidden", x)
        return x


def test_flax_warns_when_a_model_sows_outside_capture():
    with pytest.warns(DeprecationWarning, match=r"Module\.sow\(\)' outside of 'nnx\.capture"):
        Sows()(jnp.ones(2))


def test_outside_capture_silences_that_warning_and_keeps_what_was_sown():
    model = Sows()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with outside_capture():
            model(jnp.ones(2))
    assert isinstance(model.hidden, nnx.Intermediate)


def test_outside_capture_keeps_every_other_warning():
    with pytest.warns(DeprecationWarning, match="another deprecation"), outside_capture():
        warnings.warn("another deprecation", DeprecationWarning, stacklevel=1)
