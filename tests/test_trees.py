import numpy as np
import pytest

from conformance.core.trees import (
    LeafSpec,
    PathMapError,
    check_bijection,
    flatten,
    layer_table,
    map_paths,
    restack,
    structure_diff,
    unflatten,
)

RULES = ((r"^layers_(\d+)/", r"layers/\1/"),)


def test_flatten_and_unflatten_round_trip():
    tree = {"embed": {"embedding": np.zeros(2)}, "layers_0": {"mlp": {"wi": np.ones(3)}}}
    flat = flatten(tree)
    assert sorted(flat) == ["embed/embedding", "layers_0/mlp/wi"]
    assert flatten(unflatten(flat)).keys() == flat.keys()


def test_map_paths_rewrites_layer_lists():
    mapping = map_paths(RULES, ["layers_1/attn/q", "embed/embedding"])
    assert mapping == {"layers_1/attn/q": "layers/1/attn/q", "embed/embedding": "embed/embedding"}


def test_map_paths_applies_the_first_matching_rule_once_and_no_other():
    rules = ((r"mlp/wi", "mlp/up"), (r"mlp/(\w+)", r"mlp/x_\1"), (r"^", "model/"))
    mapping = map_paths(rules, ["mlp/wi/mlp/wi", "mlp/wo", "norm"])
    assert mapping == {
        "mlp/wi/mlp/wi": "mlp/up/mlp/wi",  # the first rule, its first match only
        "mlp/wo": "mlp/x_wo",  # the second rule; the third never sees it
        "norm": "model/norm",
    }


def test_map_paths_rejects_two_sources_for_one_target():
    with pytest.raises(PathMapError, match="both 'a/x' and 'b/x'"):
        map_paths(((r"^[ab]/", "c/"),), ["a/x", "b/x"])


def test_bijection_names_unmapped_and_dangling_leaves():
    with pytest.raises(PathMapError) as err:
        check_bijection({"a": "a", "b": "z"}, ["a", "c"])
    assert "NNX leaf with no Linen source: c" in str(err.value)
    assert "Linen leaf mapped to no NNX leaf: b -> z" in str(err.value)


def test_structure_diff_reports_missing_extra_and_changed_leaves():
    f32 = LeafSpec((4, 8), "float32")
    linen = {"a": f32, "b": f32, "c": f32}
    nnx = {"a": f32, "c": LeafSpec((8, 4), "float32"), "d": f32}
    problems = structure_diff(linen, nnx, {p: p for p in linen})
    assert problems == [
        "b: Linen has it (float32[4, 8]); NNX does not",
        "c: Linen float32[4, 8] != NNX float32[8, 4]",
        "d: NNX has it (float32[4, 8]); Linen does not",
    ]


def test_structure_diff_says_what_the_other_side_holds_instead_of_a_parameter():
    f32 = LeafSpec((8,), "float32")
    problems = structure_diff(
        {"norm/scale": f32},
        {"stats/mean": f32},
        {"norm/scale": "norm/scale"},
        first_held={"stats/mean": "in collection 'batch_stats', not 'params'"},
        second_held={"norm/scale": "as flax.nnx.variablelib.Variable, not nnx.Param"},
    )
    assert problems == [
        "norm/scale: Linen has it (float32[8]); NNX holds it as "
        "flax.nnx.variablelib.Variable, not nnx.Param: it will not be trained or "
        "checkpointed as a parameter",
        "stats/mean: NNX has it (float32[8]); Linen holds it in collection 'batch_stats', "
        "not 'params': it will not be trained or checkpointed as a parameter",
    ]


STACK = ((r"^layers_(?P<layer>\d+)/", "layers/"),)


def test_layer_table_orders_layers_and_refuses_gaps():
    table = layer_table(STACK, ["layers_1/w", "layers_0/w", "head/w"])
    assert table == {"layers/w": ["layers_0/w", "layers_1/w"]}
    with pytest.raises(PathMapError, match=r"not 0\.\.n-1"):
        layer_table(STACK, ["layers_0/w", "layers_2/w"])


def test_restack_round_trips_parameters_and_their_moments():
    flat = {
        "model/layers_0/w": np.zeros((2, 3)),
        "model/layers_1/w": np.ones((2, 3)),
        "opt/mu/layers_0/w": np.full((2, 3), 2.0),
        "opt/mu/layers_1/w": np.full((2, 3), 3.0),
        "step": np.int32(4),
    }
    table = layer_table(STACK, ["layers_0/w", "layers_1/w"])
    stacked = restack(flat, table, to_scan=True)
    assert sorted(stacked) == ["model/layers/w", "opt/mu/layers/w", "step"]
    assert stacked["opt/mu/layers/w"].shape == (2, 2, 3)
    assert stacked["opt/mu/layers/w"][1, 0, 0] == 3.0
    back = restack(stacked, table, to_scan=False)
    assert all(np.array_equal(back[p], flat[p]) for p in flat)


def test_restack_stacks_on_the_axis_asked_for():
    flat = {"layers_0/w": np.zeros((2, 3)), "layers_1/w": np.ones((2, 3))}
    table = layer_table(STACK, list(flat))
    stacked = restack(flat, table, to_scan=True, axis=1)
    assert stacked["layers/w"].shape == (2, 2, 3)
    assert stacked["layers/w"][:, 1].tolist() == np.ones((2, 3)).tolist()
    back = restack(stacked, table, to_scan=False, axis=1)
    assert all(np.array_equal(back[p], flat[p]) for p in flat)
