"""Precision profiles: traced per module, compared so that moves and formula changes pass."""

import jax
import jax.numpy as jnp

from conformance.contract import PrecisionChange
from conformance.core.trees import LeafSpec
from conformance.runtime.calls import ModuleCall
from conformance.runtime.precision import (
    ROUNDING,
    SUM_OF_PRODUCTS,
    Profile,
    compare_profiles,
    profile,
    unmatched,
)

PAIRS = {"block": "block", "block/attn": "block/attn", "block/mlp": "block/mlp"}
EXP32 = ("exp", "float32", "exp")
EXP16 = ("exp", "bfloat16", "exp")
DOT16 = (SUM_OF_PRODUCTS, "bfloat16 -> bfloat16", "dot_general")
DOT32 = (SUM_OF_PRODUCTS, "bfloat16 -> float32", "dot_general")
SUM32 = (SUM_OF_PRODUCTS, "bfloat16 -> float32", "reduce_sum")


def profile_of(ops, boundary=None):
    return Profile({path: frozenset(found) for path, found in ops.items()}, boundary or {})


def test_an_operation_moved_to_the_parent_module_compares_equal():
    linen = profile_of({"block/attn": [EXP32, DOT16], "block/mlp": [EXP16]})
    nnx_ = profile_of({"block": [EXP32], "block/attn": [DOT16], "block/mlp": [EXP16]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_change_of_formula_in_one_precision_compares_equal():
    linen = profile_of({"block/attn": [("rsqrt", "float32", "rsqrt"), DOT16]})
    nnx_ = profile_of({"block/attn": [("sqrt", "float32", "sqrt"), DOT16]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_sum_and_a_dot_general_in_equal_dtypes_compare_equal():
    linen = profile_of({"block/mlp": [DOT16, SUM32]})
    nnx_ = profile_of({"block/mlp": [DOT16, DOT32]})
    assert compare_profiles(linen, nnx_, PAIRS) == []


def test_a_precision_change_is_named_at_the_deepest_module_where_it_shows():
    linen = profile_of({"block/attn": [EXP32], "block/mlp": [EXP16]})
    nnx_ = profile_of({"block/attn": [EXP16], "block/mlp": [EXP16]})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == "block/attn: NNX computes exp in bfloat16, Linen exp in float32"


def test_rounding_on_one_side_alone_is_a_precision_change():
    rounding = (ROUNDING, "float32 -> bfloat16", "convert_element_type")
    linen = profile_of({"block/mlp": [DOT32]})
    nnx_ = profile_of({"block/mlp": [DOT32, rounding]})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == (
        "block/mlp: NNX rounds float32 -> bfloat16, Linen does not round there"
    )


def test_boundary_dtypes_are_compared_per_method():
    linen = profile_of({}, {("block/mlp", "__call__"): frozenset({"in bfloat16", "out bfloat16"})})
    nnx_ = profile_of({}, {("block/mlp", "__call__"): frozenset({"in bfloat16", "out float32"})})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.describe() == "block/mlp: NNX's __call__ returns float32, Linen's bfloat16"


def test_an_accepted_change_covers_its_module_and_operations_and_a_stale_one_is_returned():
    linen = profile_of({"block/attn": [EXP32], "block/mlp": [EXP32]})
    nnx_ = profile_of({"block/attn": [EXP16], "block/mlp": [EXP16]})
    found = compare_profiles(linen, nnx_, PAIRS)
    accepted = PrecisionChange(r"block/attn", ("exp",), "softmax in the compute dtype")
    stale = PrecisionChange(r"block/attn", ("logistic",), "never differs")
    left, unused = unmatched(found, [accepted, stale])
    assert [d.linen_module for d in left] == ["block/mlp"]
    assert unused == [stale]


def test_other_modules_cannot_hide_a_precision_change():
    router = ("exp", "bfloat16", "exp")
    pairs = {"l0": "l0", "l0/attn": "l0/attn", "l1": "l1", "l1/attn": "l1/attn", "moe": "moe"}
    linen = profile_of({"l0/attn": [EXP32], "l1/attn": [EXP32], "moe": [router]})
    nnx_ = profile_of({"l0/attn": [EXP32], "l1/attn": [EXP16], "moe": [router]})
    (found,) = compare_profiles(linen, nnx_, pairs)
    assert found.describe() == "l1/attn: NNX computes exp in bfloat16, Linen exp in float32"


def test_a_sum_of_products_in_another_precision_is_named_though_the_head_computes_in_it():
    head = (SUM_OF_PRODUCTS, "float32 -> float32", "dot_general")
    linen = profile_of({"block/mlp": [DOT16], "block": [head]})
    nnx_ = profile_of({"block/mlp": [head], "block": [head]})
    (found,) = compare_profiles(linen, nnx_, PAIRS)
    assert found.linen_module == "block/mlp"


class _Runner:
    """A runner of one module call around ``body(around, w, x)``: enough to profile."""

    def __init__(self, body):
        self.body = body
        self.specs = {"w": LeafSpec((4, 4), "float32")}

    def pack(self, flat):
        return flat

    def context(self, mesh=None, *, abstract=False):
        return None

    def intercepted(self, around):
        def forward(params, context, x):
            call = ModuleCall("", "__call__", ((x,), {}))
            return around(call, lambda: self.body(around, params["w"], x))

        return forward


def _ops(body):
    found = profile(_Runner(body), jax.ShapeDtypeStruct((2, 4), jnp.bfloat16))
    return found.ops.get("", frozenset())


def test_a_widened_operand_counts_in_its_own_dtype_through_moves_of_data():
    def cast_first(around, w, x):
        return x.astype(jnp.float32).reshape(2, 4) @ w

    def reshape_first(around, w, x):
        return x.reshape(2, 4).astype(jnp.float32) @ w

    expected = {(SUM_OF_PRODUCTS, "bfloat16 x float32 -> float32", "dot_general")}
    assert _ops(cast_first) == _ops(reshape_first) == expected


def test_a_scan_carry_is_what_the_body_computes_not_what_it_started_as():
    def scanned(around, w, x):
        def body(carry, _):
            return carry @ w, None

        return jax.lax.scan(body, x.astype(jnp.float32), None, length=2)[0]

    assert _ops(scanned) == {(SUM_OF_PRODUCTS, "float32 -> float32", "dot_general")}


def test_a_cast_back_to_the_dtype_a_value_was_computed_in_is_no_rounding():
    def round_trip(around, w, x):
        return x.astype(jnp.float32).astype(jnp.bfloat16)

    def rounds(around, w, x):
        return (x.astype(jnp.float32) @ w).astype(jnp.bfloat16)

    assert _ops(round_trip) == set()
    assert (ROUNDING, "float32 -> bfloat16", "convert_element_type") in _ops(rounds)


def test_operations_belong_to_the_innermost_module_call():
    def nested(around, w, x):
        inner = ModuleCall("mlp", "__call__", ((x,), {}))
        return jnp.exp(around(inner, lambda: jnp.tanh(x)))

    found = profile(_Runner(nested), jax.ShapeDtypeStruct((2, 4), jnp.bfloat16))
    assert found.ops == {
        "": frozenset({("exp", "bfloat16", "exp")}),
        "mlp": frozenset({("tanh", "bfloat16", "tanh")}),
    }
    assert found.boundary[("mlp", "__call__")] == {"in bfloat16", "out bfloat16"}
