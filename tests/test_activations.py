"""Activation tables compared: values laid out differently, constraints asked differently."""

from conformance.checks.kernel import (
    compare_tables,
    constraint_differences,
    golden_table,
    unanswered,
)
from conformance.runtime.activations import Call, Table, render

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
ROWS = (("data", "fsdp"), None, None)
WHOLE = (None, None, None)
ASKED = "8x32x64 to P(('data', 'fsdp'), None, None) = 4x1x1 shards"


def _call(path, out=ROWS, constraints=(), method="__call__"):
    return Call(path, method, {0: ((8, 32, 64), ROWS)}, {0: ((8, 32, 64), out)}, constraints)


def _table(*calls):
    return Table(calls, MESH, {})


def test_a_value_laid_out_differently_is_named_with_both_specs_and_shards():
    linen = _table(_call("layers_0/attn"), _call(""))
    nnx_ = _table(_call("layers/0/attn", out=WHOLE), _call(""))
    (found,) = compare_tables(linen, nnx_, {"layers_0/attn": "layers/0/attn"})
    assert found.describe(MESH) == (
        "layers_0/attn (NNX layers/0/attn) __call__ output 0 [8x32x64]: "
        "Linen P(('data', 'fsdp'), None, None) = 4x1x1 shards, "
        "NNX P(None, None, None) = 1x1x1 shards"
    )


def test_calls_pair_in_order_and_unpaired_modules_are_left_out():
    linen = _table(_call("embed"), _call("embed", out=WHOLE), _call("extra", out=WHOLE))
    nnx_ = _table(_call("embed"), _call("embed", out=WHOLE))
    assert compare_tables(linen, nnx_, {"embed": "embed"}) == []


def test_a_dropped_constraint_is_named_at_the_deepest_module():
    pairs = {"layers_0": "layers/0", "layers_0/attn": "layers/0/attn"}
    linen = _table(_call("layers_0/attn", constraints=(ASKED,)), _call("layers_0"), _call(""))
    nnx_ = _table(_call("layers/0/attn"), _call("layers/0"), _call(""))
    (found,) = constraint_differences(linen, nnx_, pairs)
    assert found.describe() == f"layers_0/attn (NNX layers/0/attn): Linen alone constrains {ASKED}"


def test_a_constraint_moved_to_the_enclosing_module_compares_equal():
    pairs = {"layers_0": "layers/0", "layers_0/attn": "layers/0/attn"}
    linen = _table(_call("layers_0/attn", constraints=(ASKED,)), _call("layers_0"), _call(""))
    nnx_ = _table(_call("layers/0/attn"), _call("layers/0", constraints=(ASKED,)), _call(""))
    assert constraint_differences(linen, nnx_, pairs) == []


def test_the_golden_table_keys_calls_by_module_and_method():
    table = _table(_call("embed", constraints=(ASKED,)), _call("embed", method="attend"), _call(""))
    found = golden_table(table)
    assert sorted(found) == ["(top) __call__", "embed __call__", "embed attend"]
    assert found["embed __call__"]["constrains"] == [ASKED]
    assert "constrains" not in found["embed attend"]


def test_render_counts_the_shards_of_each_dimension():
    assert render(ROWS, MESH) == "P(('data', 'fsdp'), None, None) = 4x1x1 shards"


def test_a_value_recomputed_in_another_layout_on_one_side_is_named():
    relaid = ("output 0 also P(None, None, None)",)
    linen = _table(Call("mlp", "__call__", {}, {0: ((8, 32, 64), ROWS)}, (), relaid))
    nnx_ = _table(_call("mlp"))
    (found,) = compare_tables(linen, nnx_, {"mlp": "mlp"})
    assert found.describe(MESH) == (
        "mlp __call__: Linen recomputes output 0 also P(None, None, None), "
        "NNX recomputes nothing in another layout"
    )


def test_a_side_whose_probes_went_unanswered_is_named_not_compared_as_equal():
    answered = Table((_call(""), _call("mlp")), MESH, {}, traced=2)
    silent = Table((), MESH, {}, traced=2)
    assert compare_tables(answered, silent, {"mlp": "mlp"}) == []
    (found,) = unanswered(answered, silent)
    assert found.startswith("NNX: the partitioner answered none of the probes of its 2 module")
    assert "persistent compilation cache" in found
    assert unanswered(answered, answered) == []
    assert unanswered(_table(), _table()) == [], "a table of no traced call is not a silence"
