"""Precision profiles compared: moves and formula changes pass, precision changes do not."""

from conformance.contract import PrecisionChange
from conformance.runtime.precision import (
    ROUNDING,
    SUM_OF_PRODUCTS,
    Profile,
    compare_profiles,
    unmatched,
)

PAIRS = {"block": "block", "block/attn": "block/attn", "block/mlp": "block/mlp"}
EXP32 = ("exp", "float32", "exp")
EXP16 = ("exp", "bfloat16", "exp")
DOT16 = (SUM_OF_PRODUCTS, "bfloat16 -> bfloat16", "dot_general")
DOT32 = (SUM_OF_PRODUCTS, "bfloat16 -> float32", "dot_general")
SUM32 = (SUM_OF_PRODUCTS, "bfloat16 -> float32", "reduce_sum")


def profile(ops, boundary=None):
    return Profile({path: frozenset(found) for path, found in ops.items()}, boundary or {})


def test_an_operation_moved_to_the_parent_module_compares_equal():
    linen = profile({"block/attn": [EXP32, DOT16], "block/mlp": [EXP16]})
    nnx_ = profile({"block": [EXP32], "block/attn": [DOT16], "block/mlp": [EXP16]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_change_of_formula_in_one_precision_compares_equal():
    linen = profile({"block/attn": [("rsqrt", "float32", "rsqrt"), DOT16]})
    nnx_ = profile({"block/attn": [("sqrt", "float32", "sqrt"), DOT16]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_sum_and_a_dot_general_in_equal_dtypes_compare_equal():
    linen = profile({"block/mlp": [DOT16, SUM32]})
    nnx_ = profile({"block/mlp": [DOT16, DOT32]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_precision_change_is_named_at_the_deepest_module_where_it_shows():
    linen = profile({"block/attn": [EXP32], "block/mlp": [EXP16]})
    nnx_ = profile({"block/attn": [EXP16], "block/mlp": [EXP16]})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == "block/attn: NNX computes exp in bfloat16, Linen exp in float32"


def test_rounding_on_one_side_alone_is_a_precision_change():
    rounding = (ROUNDING, "float32 -> bfloat16", "convert_element_type")
    linen = profile({"block/mlp": [DOT32]})
    nnx_ = profile({"block/mlp": [DOT32, rounding]})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == (
        "block/mlp: NNX rounds float32 -> bfloat16, Linen does not round there"
    )


def test_boundary_dtypes_are_compared_per_method():
    linen = profile({}, {("block/mlp", "__call__"): frozenset({"in bfloat16", "out bfloat16"})})
    nnx_ = profile({}, {("block/mlp", "__call__"): frozenset({"in bfloat16", "out float32"})})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == "block/mlp: NNX's __call__ returns float32, Linen's bfloat16"


def test_an_accepted_change_covers_its_module_and_operations_and_a_stale_one_is_returned():
    linen = profile({"block/attn": [EXP32], "block/mlp": [EXP32]})
    nnx_ = profile({"block/attn": [EXP16], "block/mlp": [EXP16]})
    found = compare_profiles(linen, nnx_, PAIRS)
    accepted = PrecisionChange(r"block/attn", ("exp",), "softmax in the compute dtype")
    stale = PrecisionChange(r"block/attn", ("logistic",), "never differs")
    left, unused = unmatched(found, [accepted, stale])
    assert [d.linen_module for d in left] == ["block/mlp"]
    assert unused == [stale]
