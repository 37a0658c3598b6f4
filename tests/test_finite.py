"""What `finite` holds logits to: masked -inf entries pass, unusable logits do not."""

import numpy as np

from conformance.checks.forward import unusable


def test_a_masked_entry_beside_finite_logits_passes():
    logits = np.array([[[1.0, -np.inf, 2.0], [0.5, 0.0, -np.inf]]])
    assert not unusable(logits).any()


def test_nan_and_positive_infinity_fail_where_they_are():
    logits = np.array([[[1.0, np.nan, 2.0], [np.inf, 0.0, 1.0]]])
    assert unusable(logits).tolist() == [[[False, True, False], [True, False, False]]]


def test_a_position_whose_logits_are_all_masked_fails_whole():
    logits = np.array([[[1.0, 0.0], [-np.inf, -np.inf]]])
    assert unusable(logits).tolist() == [[[False, False], [True, True]]]
