import numpy as np
import pytest

from conformance.trees import (
    LeafSpec,
    PathMapError,
    check_bijection,
    flatten,
    map_paths,
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
        "b: Linen has it (as b, float32[4, 8]); NNX does not",
        "c: Linen float32[4, 8] (as c) != NNX float32[8, 4]",
        "d: NNX has it (float32[4, 8]); Linen does not",
    ]
