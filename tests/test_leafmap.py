"""Leaf transforms: each moves values, shapes and logical names, and comes back exactly."""

import dataclasses

import jax
import numpy as np
import pytest

from conformance.contract import Reshape, Split, Stack, Transpose
from conformance.core.leafmap import build
from conformance.core.trees import LeafSpec, PathMapError, map_paths

SPLIT = Split(r"(.*)/wi/kernel$", (r"\1/wi_0/kernel", r"\1/wi_1/kernel"))
STACK = Stack((r"(.*)/k/kernel$", r"(.*)/v/kernel$"), r"\1/kv/kernel")
RULES = (
    SPLIT,
    STACK,
    Transpose(r"^out/kernel$", "head/kernel", (1, 0)),
    Reshape(r"^attn/q/kernel$", "attn/query/kernel", (4, 2, -1)),
    (r"^emb/", "embed/"),
)
SHAPES = {
    "mlp/wi/kernel": (2, 4, 6),
    "attn/k/kernel": (4, 6),
    "attn/v/kernel": (4, 6),
    "out/kernel": (3, 5),
    "attn/q/kernel": (4, 6),
    "emb/embedding": (7, 4),
}
CANONICAL = {
    "mlp/wi_0/kernel": (4, 6),
    "mlp/wi_1/kernel": (4, 6),
    "attn/kv/kernel": (2, 4, 6),
    "head/kernel": (5, 3),
    "attn/query/kernel": (4, 2, 3),
    "embed/embedding": (7, 4),
}


def _values(shapes):
    rng = np.random.default_rng(0)
    return {path: rng.normal(size=shape).astype(np.float32) for path, shape in shapes.items()}


def test_every_transform_moves_values_and_back_exactly():
    leaf_map = build(RULES, SHAPES)
    flat = _values(SHAPES)
    canonical = leaf_map.canonical(flat)
    assert {p: v.shape for p, v in canonical.items()} == CANONICAL
    np.testing.assert_array_equal(canonical["mlp/wi_1/kernel"], flat["mlp/wi/kernel"][1])
    np.testing.assert_array_equal(canonical["attn/kv/kernel"][1], flat["attn/v/kernel"])
    np.testing.assert_array_equal(canonical["head/kernel"], flat["out/kernel"].T)
    back = leaf_map.own(canonical)
    assert list(back) == list(flat)
    for path, value in flat.items():
        np.testing.assert_array_equal(back[path], value)


def test_device_arrays_move_like_host_arrays():
    leaf_map = build(RULES, SHAPES)
    flat = _values(SHAPES)
    on_device = leaf_map.canonical({p: jax.numpy.asarray(v) for p, v in flat.items()})
    for path, value in leaf_map.canonical(flat).items():
        np.testing.assert_array_equal(np.asarray(on_device[path]), value)


def test_state_mirroring_a_parameter_moves_with_it_and_counters_stay():
    leaf_map = build(RULES, SHAPES)
    params = _values(SHAPES)
    state = {f"model/{p}": v for p, v in params.items()}
    state |= {f"optimizer/mu/{p}": v + 1 for p, v in params.items()}
    state["optimizer/step"] = np.int32(3)
    canonical = leaf_map.canonical(state)
    assert "optimizer/mu/mlp/wi_0/kernel" in canonical
    assert "model/attn/kv/kernel" in canonical
    assert canonical["optimizer/step"] == 3
    back = leaf_map.own(canonical)
    assert sorted(back) == sorted(state)
    np.testing.assert_array_equal(back["optimizer/mu/out/kernel"], state["optimizer/mu/out/kernel"])


def test_shapes_and_logical_names_follow_their_own_twins():
    leaf_map = build(RULES, SHAPES)
    specs = leaf_map.canonical({p: LeafSpec(s, "float32") for p, s in SHAPES.items()})
    assert {p: s.shape for p, s in specs.items()} == CANONICAL
    logical = {
        "mlp/wi/kernel": ("stack", "embed", "mlp"),
        "attn/k/kernel": ("embed", "kv"),
        "attn/v/kernel": ("embed", "kv"),
        "out/kernel": ("embed", "vocab"),
        "attn/q/kernel": ("embed", "heads"),
        "emb/embedding": None,
    }
    assert leaf_map.canonical(logical) == {
        "mlp/wi_0/kernel": ("embed", "mlp"),
        "mlp/wi_1/kernel": ("embed", "mlp"),
        "attn/kv/kernel": (None, "embed", "kv"),
        "head/kernel": ("vocab", "embed"),
        "attn/query/kernel": ("embed", "heads", None),
        "embed/embedding": None,
    }
    abstract = leaf_map.canonical({"out/kernel": jax.ShapeDtypeStruct((3, 5), np.float32)})
    assert abstract["head/kernel"].shape == (5, 3)


def test_merged_axes_keep_a_name_only_when_one_axis_has_it():
    merge = build((Reshape("^w$", "w", (24,)),), {"w": (4, 6)})
    assert merge.canonical({"w": ("embed", None)}) == {"w": ("embed",)}
    with pytest.raises(PathMapError, match="merge into one"):
        merge.canonical({"w": ("embed", "mlp")})


def test_the_first_matching_rule_takes_a_path_whether_it_renames_or_transforms():
    rules = ((r"^mlp/wi/", "mlp/renamed/"), SPLIT)
    assert build(rules, SHAPES).canonical(_values(SHAPES)).keys() >= {"mlp/renamed/kernel"}
    first = build((SPLIT, STACK, (r"^mlp/wi/", "mlp/renamed/")), SHAPES).origins()
    assert first["mlp/wi_0/kernel"] == "mlp/wi/kernel [0]"
    assert first["attn/kv/kernel"] == "attn/k/kernel+attn/v/kernel"


@pytest.mark.parametrize(
    ("rule", "shapes", "message"),
    [
        (SPLIT, {"mlp/wi/kernel": (3, 4)}, "axis 0 must have 2 entries"),
        (STACK, {"attn/k/kernel": (4, 6)}, r"no leaf matches \['\(\.\*\)/v/kernel\$'\]"),
        (STACK, {"attn/k/kernel": (4, 6), "attn/v/kernel": (4, 5)}, "cannot stack"),
        (Transpose("w", "w", (0,)), {"w": (2, 3)}, "cannot transpose w"),
        (Reshape("w", "w", (5, -1)), {"w": (2, 3)}, "cannot reshape w"),
        (Split("w", ("a", "a")), {"w": (2, 3)}, "the map must be one-to-one"),
    ],
)
def test_a_transform_that_does_not_fit_its_leaves_is_named(rule, shapes, message):
    with pytest.raises(PathMapError, match=message):
        build((rule,), shapes)


def test_coverage_names_leaves_reached_twice_or_never():
    leaf_map = build(RULES, SHAPES)
    leaf_map.check_covers(CANONICAL, SHAPES)
    with pytest.raises(
        PathMapError, match=r"Linen leaf mapped to no NNX leaf: mlp/wi/kernel \[1\]"
    ):
        leaf_map.check_covers({**CANONICAL, "extra": ()}.keys() - {"mlp/wi_1/kernel"}, SHAPES)


def test_a_state_missing_part_of_a_group_cannot_move():
    leaf_map = build(RULES, SHAPES)
    with pytest.raises(PathMapError, match="must move together"):
        leaf_map.canonical({"attn/k/kernel": np.zeros((4, 6))})


def test_a_name_only_map_refuses_a_path_a_transform_takes():
    assert map_paths(RULES, ["emb/embedding"]) == {"emb/embedding": "embed/embedding"}
    with pytest.raises(PathMapError, match="changes the layout of mlp/wi/kernel"):
        map_paths(RULES, ["mlp/wi/kernel"])


def test_an_abstract_arrays_mesh_axes_move_with_its_shape():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp", "tensor"))
    leaf_map = build(RULES, SHAPES)
    abstract = {"mlp/wi/kernel": jax.ShapeDtypeStruct((2, 4, 6), np.float32, sharding=sharded)}
    moved = leaf_map.canonical(abstract)["mlp/wi_1/kernel"]
    assert moved.shape == (4, 6)
    assert moved.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_size_one_axes_hold_no_name_through_a_reshape():
    squeeze = build((Reshape("^w$", "w", (6,)),), {"w": (1, 6)})
    assert squeeze.canonical({"w": (None, "embed")}) == {"w": ("embed",)}
    expand = build((Reshape("^w$", "w", (1, 6)),), {"w": (6,)})
    assert expand.canonical({"w": ("embed",)}) == {"w": (None, "embed")}
    middle = build((Reshape("^w$", "w", (4, 6)),), {"w": (4, 1, 6)})
    assert middle.canonical({"w": ("embed", None, "mlp")}) == {"w": ("embed", "mlp")}


def test_a_stack_given_one_part_twice_or_an_axis_out_of_range_is_named():
    twice = Stack((r"^(\w+)/k/kernel$", r"^(\w+)/v/kernel$"), r"\1/kv/kernel")
    shapes = {"a/k/kernel": (2,), "a/v/kernel": (2,)}
    with pytest.raises(PathMapError, match="stacks both"):
        build((Stack((r"^\w/k/x$", r"^\w/v/x$"), "kv"),), {"a/k/x": (2,), "b/k/x": (2,)})
    with pytest.raises(PathMapError, match="on that axis"):
        build((dataclasses.replace(twice, axis=3),), shapes)


def test_rules_given_as_lists_work_as_tuples():
    rules = [["^emb/", "embed/"], Split(r"(.*)/wi/kernel$", [r"\1/a", r"\1/b"])]
    leaf_map = build(rules, {"emb/x": (3,), "mlp/wi/kernel": (2, 3)})
    assert sorted(leaf_map.canonical({"emb/x": 1, "mlp/wi/kernel": "kind"})) == [
        "embed/x",
        "mlp/a",
        "mlp/b",
    ]
