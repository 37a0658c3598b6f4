import jax.numpy as jnp
import numpy as np
import pytest

from conformance.core.numerics import (
    POLICY,
    Tolerance,
    compare_arrays,
    compare_trees,
    tolerance_for,
)
from conformance.core.rounding import nudge_covered, one_ulp_nudge, within_rounding


def test_equal_arrays_agree():
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    assert compare_arrays("w", x, x.copy()) is None


def test_mismatch_names_path_index_values_and_tolerance():
    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    b[1, 2] = 0.5
    found = compare_arrays("layers/0/mlp/wi/kernel", a, b)
    assert found is not None
    assert found.index == (1, 2)
    assert (found.first, found.second, found.count) == (0.0, 0.5, 1)
    text = found.describe()
    for needle in ("layers/0/mlp/wi/kernel", "[1, 2]", "Linen=0.0", "NNX=0.5", "atol=1e-05"):
        assert needle in text


def test_nan_on_one_side_fails_and_is_named():
    a = np.ones(4, np.float32)
    b = a.copy()
    b[3] = np.nan
    found = compare_arrays("logits", a, b)
    assert found is not None
    assert found.index == (3,)
    assert "non-finite on one side only" in found.reason


def test_same_nonfinite_on_both_sides_agrees():
    a = np.array([1.0, np.nan, np.inf], np.float32)
    assert compare_arrays("x", a, a.copy()) is None


def test_different_nonfinite_values_on_both_sides_fail_named_as_such():
    a = np.array([1.0, np.inf, -np.inf, 2.0], np.float32)
    b = np.array([1.0, -np.inf, np.nan, np.nan], np.float32)
    found = compare_arrays("logits", a, b)
    assert found is not None
    assert found.count == 3
    assert found.reason == (
        "1 non-finite on one side only; 2 non-finite on both sides, differently (NaN, +inf, -inf)"
    )


def test_errors_of_opposite_sign_do_not_cancel():
    a = np.zeros(4, np.float32)
    b = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    found = compare_arrays("x", a, b)
    assert found is not None
    assert found.count == 4


def test_within_tolerance_agrees_and_just_outside_fails():
    tol = POLICY["float32"]
    b = np.full(3, 100.0)
    inside = b + 0.9 * (tol.atol + tol.rtol * 100.0)
    outside = b + 1.1 * (tol.atol + tol.rtol * 100.0)
    assert compare_arrays("x", inside, b, tol) is None
    assert compare_arrays("x", outside, b, tol) is not None


def test_bfloat16_tolerance_is_looser():
    assert tolerance_for("bfloat16").rtol > tolerance_for("float32").rtol
    assert tolerance_for("int32") == Tolerance(0.0, 0.0)


def test_reference_tie_break_accepts_only_a_no_worse_second_side():
    tol = Tolerance(0.0, 0.0)
    first, second = np.array([1.0]), np.array([1.1])
    assert compare_arrays("x", first, second, tol, reference=np.array([1.2])) is None
    assert compare_arrays("x", first, second, tol, reference=np.array([0.9])) is not None


def test_the_report_says_what_its_errors_cover_and_what_the_tie_break_accepted():
    first, second = np.array([1.0, 1.0, 1.0]), np.array([1.1, 1.1, 1.5])
    reference = np.array([1.2, 1.2, 0.9])
    found = compare_arrays("x", first, second, Tolerance(0.0, 0.0), reference=reference)
    assert (found.count, found.accepted) == (1, 2)
    text = found.describe()
    assert "over the 1 differing elements: max |a-b|=5.000e-01" in text
    assert "the tie-break accepted 2 more elements outside tolerance" in text


def test_spread_accepts_only_what_the_second_side_moves_by_itself():
    tol = Tolerance(1e-5, 0.0)
    first = np.array([1.0, 1.0, 1.0])
    second = np.array([1.1, 1.5, 1.00002])
    spread = np.array([1.2, 1.5, 1.0])  # the second side computed in another order
    found = compare_arrays("x", first, second, tol, spread=spread)
    assert (found.count, found.spread_covered, found.index) == (1, 2, (1,))
    assert "2 more elements outside tolerance were within NNX's own spread" in found.describe()
    assert compare_arrays("x", first, second, tol, spread=second) is not None
    assert compare_trees({"x": first}, {"x": second}, tol, spread={"x": spread})[0].count == 1


def test_shape_mismatch_is_reported():
    found = compare_arrays("x", np.zeros((2, 3)), np.zeros((3, 2)))
    assert found is not None
    assert found.describe() == "x: shape [2, 3] on Linen, [3, 2] on NNX"


def test_tree_with_leaf_on_one_side_only_is_a_mismatch():
    found = compare_trees({"a": np.zeros(2), "b": np.zeros(2)}, {"a": np.zeros(2)})
    assert [m.path for m in found] == ["b"]
    assert found[0].describe() == "b: Linen has this leaf, NNX does not"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_policy_matches_design(dtype):
    expected = {"float32": (1e-5, 1.3e-6), "bfloat16": (1e-5, 1.6e-2)}[dtype]
    assert (POLICY[dtype].atol, POLICY[dtype].rtol) == expected


def test_an_exact_zero_on_the_other_side_has_no_relative_error():
    found = compare_arrays("grads/bias", np.array([0.5, 1e-3, 2.0]), np.array([0.0, 0.0, 1.0]))
    assert found.zeros == 2
    assert found.max_rel == 1.0
    text = found.describe()
    assert "max rel=1.000e+00 (2 where NNX is exactly 0: no relative error there)" in text
    only_zero = compare_arrays("grads/bias", np.array([1e-3]), np.array([0.0]))
    assert "max rel=none (1 where NNX is exactly 0" in only_zero.describe()


def test_nudge_covered_accepts_only_what_lies_where_a_nudge_moves_the_result():
    expected = {"grads/w": np.array([1.0, 2.0, 3.0, 4.0], np.float32), "step": np.array(1)}
    moved = [
        {"grads/w": np.array([1.0, 2.0 + 1e-3, 3.0, 4.0], np.float32), "step": np.array(1)},
        {"grads/w": np.array([1.0 + 1e-6, 2.0, 3.0, 4.0], np.float32), "step": np.array(1)},
    ]

    def off(**at):
        values = expected["grads/w"].copy()
        for index, by in at.items():
            values[int(index[1:])] += np.float32(by)
        return {"grads/w": values, "step": np.array(2)}

    adjusted, covered = nudge_covered(expected, off(i1=8e-4), moved)
    assert covered == 1
    assert adjusted["grads/w"][1] == expected["grads/w"][1]
    assert [m.path for m in compare_trees(expected, adjusted)] == ["step"]
    adjusted, covered = nudge_covered(expected, off(i1=8e-4, i3=np.inf), moved)
    assert covered == 0
    assert compare_trees(expected, adjusted)[0].index == (3,)
    assert nudge_covered(expected, off(i1=1.5e-3), moved)[1] == 0  # beyond the nudges
    assert nudge_covered(expected, off(i1=-8e-4), moved)[1] == 0  # the other way
    assert nudge_covered(expected, off(i1=8e-4, i0=3e-3), moved)[1] == 0  # the leaf moved more


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_one_ulp_nudge_moves_every_float_element_one_step(dtype):
    values = jnp.asarray([1.0, -2.5, 0.0, 3.0], dtype)
    nudged = one_ulp_nudge({"w": values, "count": np.arange(3)}, seed=0)
    original = np.asarray(values)
    assert nudged["w"].dtype == original.dtype
    steps = [np.nextafter(original, np.asarray(t, original.dtype)) for t in (448.0, -448.0)]
    assert np.all((nudged["w"] == steps[0]) | (nudged["w"] == steps[1]))
    assert np.all(nudged["w"] != original)
    np.testing.assert_array_equal(nudged["count"], np.arange(3))


def _bfloat16_twins():
    """A float32 result and two bfloat16 computations of it that round differently."""
    exact = np.random.default_rng(0).normal(size=(8, 256)).astype(np.float32)
    rounded = np.asarray(jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32))
    again = np.array(jnp.asarray(exact * (1 + 5e-4), jnp.bfloat16).astype(jnp.float32))
    return exact, rounded, again


def test_within_rounding_accepts_another_rounding_of_the_same_values():
    exact, rounded, again = _bfloat16_twins()
    verdict = within_rounding(rounded, again, exact)
    assert verdict.accepted, verdict.text
    assert verdict.text.endswith("rounding, accepted")


def test_within_rounding_refuses_what_moves_farther_than_rounding():
    exact, rounded, _ = _bfloat16_twins()
    verdict = within_rounding(rounded, rounded * 1.05, exact)
    assert not verdict.accepted
    assert "farther than rounding moves it" in verdict.text
    assert "2x the reference's own" in verdict.text


def test_within_rounding_refuses_a_non_finite_value():
    exact, rounded, again = _bfloat16_twins()
    again[0, 0] = np.nan
    assert not within_rounding(rounded, again, exact).accepted
