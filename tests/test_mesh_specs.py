import pytest
from jax.sharding import PartitionSpec as P

from conformance.core.sharding import (
    MeshSpec,
    MeshSpecError,
    UnknownLogicalAxis,
    indivisible,
    parse_mesh,
    resolve_spec,
)

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ("norm", None))


@pytest.mark.parametrize(
    ("text", "mesh_id"),
    [
        ("fsdp=8", "fsdp8"),
        ("data=2,fsdp=2,tensor=2", "data2-fsdp2-tensor2"),
        ("4x8x8", "data4-fsdp8-tensor8"),
        ("data2-fsdp2-tensor2", "data2-fsdp2-tensor2"),
    ],
)
def test_parse_valid_forms(text, mesh_id):
    assert parse_mesh(text).id == mesh_id


@pytest.mark.parametrize("text", ["3x3", "fsdp=0", "fsdp=", "x", "", "fsdp=2,fsdp=4", "a=b"])
def test_malformed_specs_name_the_valid_forms(text):
    with pytest.raises(MeshSpecError, match="axis=N"):
        parse_mesh(text)


def test_too_few_devices_is_a_clear_error():
    from conformance.core.sharding import InsufficientDevices

    with pytest.raises(InsufficientDevices, match="needs 4096 devices"):
        parse_mesh("16x16x16").devices()


def test_resolve_drops_absent_axes_and_never_reuses_one():
    mesh = MeshSpec((("fsdp", 8),))
    assert resolve_spec(("batch", "embed"), RULES, mesh) == P("fsdp", None)
    assert resolve_spec(("embed", "mlp"), RULES, mesh) == P("fsdp", None)


def test_resolve_first_rule_wins():
    rules = (("embed", "fsdp"), ("embed", "tensor"))
    mesh = parse_mesh("2x2x2")
    assert resolve_spec(("embed",), rules, mesh) == P("fsdp")


def test_unknown_logical_name_is_an_error():
    with pytest.raises(UnknownLogicalAxis):
        resolve_spec(("embde",), RULES, parse_mesh("fsdp=8"))


def test_indivisible_dimensions_are_listed():
    mesh = parse_mesh("fsdp=8")
    assert indivisible((50257, 64), P("fsdp", None), mesh) == [(0, 50257, 8)]
    assert indivisible((64, 64), P("fsdp", None), mesh) == []
