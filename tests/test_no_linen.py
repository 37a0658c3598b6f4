"""A family whose Linen was deleted: NNX against its recorded references and its goldens."""

import dataclasses

import pytest

from conformance.checks.registry import BUILTIN
from conformance.contract import Family, FamilyError, Pair, Recorded, problems
from conformance.core.goldens import dumps, normalise
from conformance.core.references import references_root
from conformance.core.roots import Goldens
from conformance.core.sharding import parse_mesh
from conformance.pytest_plugin.plan import plan, skip_reason
from conformance.pytest_plugin.session import Settings
from conformance.pytest_plugin.tiers import get_tier
from conformance_models import GOLDENS
from conformance_models.gpt3.family import Gpt3Family
from tests.suite_run import TOPOLOGY, run_check

MESH = parse_mesh("data=2,fsdp=2,tensor=2")


class Gpt3WithoutLinen(Gpt3Family):
    """gpt3 after its Linen implementation was deleted: NNX and the recorded Linen remain."""

    linen_module = Family.linen_module


class NothingToCompare(Gpt3WithoutLinen):
    """No Linen and no recorded reference."""

    def features(self):
        return tuple(f for f in super().features() if not isinstance(f, Recorded))


FAMILY = Gpt3WithoutLinen()


def test_without_linen_and_references_is_a_declaration_error():
    assert not FAMILY.has_linen
    assert not problems(FAMILY)
    with pytest.raises(FamilyError, match="has no Linen module"):
        FAMILY.linen_module(None)
    (found,) = problems(NothingToCompare())
    assert "defines no linen_module and declares no recorded reference" in found


def _planned():
    run = Settings((FAMILY,), (MESH,), (TOPOLOGY,), get_tier("full"), "low", Goldens(None))
    return [p for check in BUILTIN.values() for p in plan(check, FAMILY, run)]


def test_every_test_runs_nnx_alone_or_skips_saying_linen_is_gone():
    ran = set()
    for planned in _planned():
        reason = skip_reason(planned)
        backend = planned.params.get("backend")
        pair = planned.values.get("pair", Pair.LINEN_NNX)
        uses_linen = (planned.check.pair and pair == Pair.LINEN_NNX) or (
            backend is not None and backend.value == "linen"
        )
        if uses_linen:
            assert reason is not None
            assert "has no Linen module (Linen was deleted)" in reason
        elif reason is None:
            ran.add(planned.check.name)
    expected = {
        "finite",
        "structure",
        "provenance",
        "sharding",
        "sharding_topology",
        "sharding_invariance",
        "checkpoint_roundtrip",
        "resume",
        "state_hygiene",
        "recorded_forward",
        "recorded_train_step",
        "recorded_resume",
        "recorded_decode",
        "recorded_quant_forward",
        "tree_mode",
        "explicit_sharding",
        "forward",  # on the mode pairs: the NNX model in two modes needs no Linen
        "train_step",
        "decode",
        "init",
        "cost",
        "resume_conversion",
        "activation_sharding",
    }
    assert ran == expected


@pytest.mark.parametrize(("check", "golden"), [("structure", "tiny-loop"), ("sharding", None)])
def test_structure_and_sharding_match_the_goldens_with_nnx_alone(tmp_path, check, golden):
    payload = run_check(check, FAMILY, tmp_path, MESH)
    name = golden or f"{MESH.id}-loop"
    path = GOLDENS / "gpt3" / check / f"{name}.json"
    assert dumps(normalise(payload)) + "\n" == path.read_text()


@pytest.mark.parametrize("check", ["recorded_forward", "recorded_train_step", "recorded_decode"])
def test_nnx_alone_agrees_with_the_recorded_linen(tmp_path, check):
    assert (references_root(GOLDENS) / "gpt3" / "linen").is_dir()
    run_check(check, FAMILY, tmp_path, MESH, params={"backend": "nnx"})


def test_an_unknown_axis_is_an_error_not_a_quantization_axis():
    check = dataclasses.replace(BUILTIN["forward"], axes=("family", "precision"))
    run = Settings((FAMILY,), (MESH,), (TOPOLOGY,), get_tier("full"), "low", Goldens(None))
    with pytest.raises(ValueError, match="unknown axis 'precision'; axes: family, size"):
        plan(check, FAMILY, run)
