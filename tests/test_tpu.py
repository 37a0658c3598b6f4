"""TPU targets as values, what a family compiles for them, and their usage errors.

None of these needs libtpu: the compiles for TPU slices run in ``make test-tpu``; the
placed shardings are read here from programs compiled for the CPU mesh.
"""

import dataclasses

import jax
import pytest

from conformance import families
from conformance.checks.tpu import DoesNotFit, Refused, compiled_for
from conformance.core import tpu
from conformance.core.sharding import parse_mesh
from conformance.core.tpu import (
    Topology,
    TopologyError,
    TpuTarget,
    compiles,
    default_mesh,
    production_target,
)
from conformance.families import Topologies
from conformance.pytest_plugin import session
from conformance.pytest_plugin.session import _tpu_targets
from conformance.runtime.aot import (
    NOT_READ,
    Program,
    abstract_batch,
    batch_rows,
    held,
    lowered_decode_step,
    lowered_forward,
    lowered_train_step,
    placements,
)
from conformance.runtime.case import BATCH_SIZE, Case
from conformance.runtime.sides import live_pair


@pytest.mark.parametrize(
    ("text", "chips", "hbm_gib"),
    [("v5p:4x4x4", 64, 95), ("v6e:2x4", 8, 32), ("v5e:2x2", 4, 16), ("v4:2x2x2", 8, 32)],
)
def test_topologies_parse_with_their_chips_and_memory(text, chips, hbm_gib):
    topology = Topology.parse(text)
    assert (topology.name, topology.chips, topology.hbm_bytes) == (text, chips, hbm_gib * 2**30)
    assert ":" not in topology.id


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("v5p", "not of the form 'GEN:AxB[xC]'"),
        ("v5p:4", "not of the form"),
        ("tpu:2x2", "not of the form"),
        ("v9z:2x2", "unknown generation 'v9z' (known: v4, v5e, v5p, v6e)"),
        ("v6e:2x4@prod", "'@prod' is not '@production'"),
        ("v5e:2x2=fsdp=8", "mesh fsdp8 needs 8 chips; v5e:2x2 has 4"),
        ("v5e:2x2=fsdp:4", "malformed mesh spec"),
    ],
)
def test_malformed_targets_are_one_line_errors(text, words):
    with pytest.raises(TopologyError) as raised:
        TpuTarget.parse(text)
    assert words in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_target_reads_back_from_its_spec():
    for text in ("v6e:2x4", "v5p:4x4x4@production", "v5e:2x2=fsdp=4"):
        target = TpuTarget.parse(text)
        assert TpuTarget.parse(target.spec) == target


def test_default_meshes_use_every_chip():
    assert default_mesh(8).id == "data2-fsdp2-tensor2"
    assert default_mesh(4).id == "fsdp2-tensor2"
    assert default_mesh(64).id == "data2-fsdp16-tensor2"
    assert all(default_mesh(n).size == n for n in (1, 2, 4, 8, 16, 64, 256))


def test_production_sizes_compile_scanned_and_the_device_size_in_every_layout():
    small, large = TpuTarget.parse("v6e:2x4"), TpuTarget.parse("v5p:4x4x4@production")
    found = compiles((small, large), ("tiny", "8b"), (False, True))
    assert [c.id for c in found] == [
        "tiny-v6e-2x4-data2-fsdp2-tensor2-loop",
        "tiny-v6e-2x4-data2-fsdp2-tensor2-scan",
        "8b-v5p-4x4x4-data2-fsdp16-tensor2-scan",
    ]
    assert [c.id for c in compiles((large,), ("tiny",), (False,))] == []


def test_a_placed_production_size_compiles_for_its_own_slice_alone():
    small, large = TpuTarget.parse("v6e:2x4"), TpuTarget.parse("v5p:4x4x4@production")
    own = production_target("v5p:8x8x8=data=4,fsdp=64,tensor=2")
    assert own == TpuTarget.parse("v5p:8x8x8@production=data=4,fsdp=64,tensor=2")
    named = TpuTarget.parse("v5p:8x8x4@production")
    placed = {large: {"70b": own}}
    found = compiles((small, large, named), ("tiny", "8b", "70b"), (True,), placed)
    assert [c.id for c in found] == [
        "tiny-v6e-2x4-data2-fsdp2-tensor2-scan",
        "8b-v5p-4x4x4-data2-fsdp16-tensor2-scan",
        "70b-v5p-8x8x8-data4-fsdp64-tensor2-scan",
        "8b-v5p-8x8x4-data2-fsdp64-tensor2-scan",
        "70b-v5p-8x8x4-data2-fsdp64-tensor2-scan",
    ]
    with pytest.raises(TopologyError, match="a placed slice takes no '@'"):
        production_target("v5p:8x8x8@production")


class Placing(type(families.get("llama"))):
    def features(self):
        return (*super().features(), Topologies({"8b": self.slice}))


def test_families_place_sizes_under_the_default_targets_only(monkeypatch):
    monkeypatch.setattr(session, "slice_devices", lambda name: ())
    family = type("Placing", (Placing,), {"slice": "v5p:8x8x4"})()
    targets, placed = _tpu_targets(["default", "v5p:8x8x8@production"], [family])
    assert [t.spec for t in targets] == [
        "v6e:2x4=data2-fsdp2-tensor2",
        "v5p:4x4x4@production=data2-fsdp16-tensor2",
        "v5p:8x8x8@production=data2-fsdp128-tensor2",
    ]
    own = TpuTarget.parse("v5p:8x8x4@production")
    assert placed == {"llama": {targets[1]: {"8b": own}}}
    found = compiles(targets, family.sizes, (False, True), placed["llama"])
    assert [c.id for c in found if c.size == "8b"] == [
        "8b-v5p-8x8x4-data2-fsdp64-tensor2-scan",
        "8b-v5p-8x8x8-data2-fsdp128-tensor2-scan",
    ]
    assert _tpu_targets(["v5p:4x4x4@production"], [family])[1] == {}
    malformed = type("Placing", (Placing,), {"slice": "v5p:8x8x4=fsdp=8"})()
    with pytest.raises(TopologyError) as raised:
        _tpu_targets(["default"], [malformed])
    assert str(raised.value) == (
        "family 'llama', size '8b': TPU target 'v5p:8x8x4=fsdp=8': mesh fsdp8 needs 8 "
        "chips; v5p:8x8x4 has 256"
    )


def test_without_libtpu_a_target_is_a_usage_error_naming_the_setup(monkeypatch):
    monkeypatch.setattr(tpu, "libtpu_version", lambda: None)
    tpu.slice_devices.cache_clear()
    with pytest.raises(TopologyError, match="make setup-tpu"):
        _tpu_targets(["default"], [])


def test_an_abstract_batch_has_a_row_per_chip_on_a_slice_as_per_device_batch_size_1():
    llama = families.get("llama")
    cpu = Case.of(llama, "tiny", mesh=parse_mesh("data=2,fsdp=2,tensor=2"))
    production = Case.of(llama, "8b", mesh=parse_mesh("data=2,fsdp=16,tensor=2"))
    assert batch_rows(cpu) == BATCH_SIZE == 8
    assert batch_rows(production) == 64  # 2 rows per batch shard: tensor splits no rows
    assert production.batch_spec()[0] == ("data", "fsdp")


def test_placed_outputs_are_keyed_by_canonical_paths_and_agree_on_a_cpu_mesh():
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    case = Case.of(families.get("llama"), "tiny", mesh=mesh, devices=mesh.devices())
    batch = abstract_batch(case, batch_rows(case))
    found = []
    for side in live_pair(case):
        for program in (lowered_forward(side, batch), lowered_train_step(side, batch)):
            found.append(placements(side, program, program.lowered.compile()))
    linen_forward, linen_step, nnx_forward, nnx_step = found
    assert set(linen_forward) == {"logits", "hidden"}
    assert linen_forward == nnx_forward
    assert linen_step == nnx_step
    assert linen_step["metrics/loss"] == []
    assert "metrics/grads/layers/0/mlp/down/kernel" in linen_step


def test_held_shardings_are_read_back_from_the_executable_in_canonical_paths():
    """Every argument the harness passes is found by its leaves' paths, whatever order a
    backend packs it in; the new state and cache come back too; unread leaves say so."""
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    case = Case.of(families.get("llama"), "tiny", mesh=mesh, devices=mesh.devices())
    rows = batch_rows(case)
    batch = abstract_batch(case, rows)
    found = []
    for side in live_pair(case):
        programs = (
            lowered_forward(side, batch),
            lowered_train_step(side, batch),
            lowered_decode_step(side, rows),
        )
        found.append([held(side, p, p.lowered.compile()) for p in programs])
    linen, nnx_ = found
    assert linen == nnx_
    forward, step, decode = nnx_
    assert forward["params/layers/0/mlp/down/kernel"] == ["tensor", "fsdp"]
    assert forward["batch/tokens"] == [["data", "fsdp"], None]
    assert forward["batch/targets"] == NOT_READ
    assert {p.split("/")[0] for p in step} == {"state", "batch", "new state"}
    assert step["new state/optimizer/opt_state/1/0/mu/layers/0/mlp/down/kernel"] == [
        "tensor",
        "fsdp",
    ]
    assert "new cache/layers/0/attn/kv_cache/key" in decode
    assert decode["batch/segment_ids"] == NOT_READ


def test_an_output_of_none_has_no_leaves_and_an_unread_argument_says_so():
    """A forward may return ``None`` for its hidden states (MaxText's does)."""
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    case = Case.of(families.get("llama"), "tiny", mesh=mesh, devices=mesh.devices())
    side = live_pair(case)[1]
    x = jax.ShapeDtypeStruct((8, 4), "float32", sharding=case.batch_sharding())
    lowered = jax.jit(lambda x, batch: (x, None)).lower(x, {"tokens": x})
    arguments = {"x": {"": x}, "batch": {"tokens": x}}
    program = Program(lowered, {0: "logits", 1: "hidden"}, {}, arguments)
    compiled = lowered.compile()
    assert placements(side, program, compiled) == {"logits": [["data", "fsdp"], None]}
    assert held(side, program, compiled) == {
        "x": [["data", "fsdp"], None],
        "batch/tokens": NOT_READ,
    }
    elsewhere = dataclasses.replace(program, arguments={"x": {"y": x}})
    with pytest.raises(LookupError, match="takes no argument of its x"):
        held(side, elsewhere, compiled)


class _Refusing:
    """A lowered program libtpu refuses with ``message``."""

    def __init__(self, message):
        self.message = message

    def compile(self):
        raise jax.errors.JaxRuntimeError(self.message)


@pytest.mark.parametrize(
    ("message", "refusal"),
    [
        ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory\nHLO", DoesNotFit),
        ("INTERNAL: Mosaic failed to compile TPU kernel `gmm.1`: Bad lhs type\nat", Refused),
    ],
)
def test_a_program_libtpu_refuses_is_a_report_of_its_first_line(message, refusal):
    with pytest.raises(refusal) as raised:
        compiled_for(_Refusing(message))
    assert type(raised.value) is refusal
    assert str(raised.value) == message.split("\n")[0]


@pytest.mark.parametrize("tier", ["smoke", "default"])
def test_the_smoke_tier_compiles_production_sizes_for_tpu_compile_alone(tier):
    """Production sizes compile scanned in every tier; probed ones wait for ``default``."""
    from conformance.checks.registry import BUILTIN
    from conformance.core.roots import Goldens
    from conformance.pytest_plugin.plan import plan
    from conformance.pytest_plugin.session import Settings
    from conformance.pytest_plugin.tiers import get_tier

    family, chosen = families.get("llama"), get_tier(tier)
    targets = (TpuTarget.parse("v6e:2x4"), TpuTarget.parse("v5p:4x4x4@production"))
    run = Settings((family,), (), (), chosen, "low", Goldens(None), tpu=targets)
    found = {
        (name, p.values["tpu"].id)
        for name in ("tpu_compile", "activation_sharding_tpu")
        for p in plan(BUILTIN[name], family, run)
        if not chosen.leaves_out(family, p.facets())
    }
    production = "8b-v5p-4x4x4-data2-fsdp16-tensor2-scan"
    device = {"tiny-v6e-2x4-data2-fsdp2-tensor2-loop"}
    if tier == "default":
        device.add("tiny-v6e-2x4-data2-fsdp2-tensor2-scan")
    expected = {
        (name, id_) for name in ("tpu_compile", "activation_sharding_tpu") for id_ in device
    }
    expected.add(("tpu_compile", production))
    if tier == "default":
        expected.add(("activation_sharding_tpu", production))
    assert found == expected
