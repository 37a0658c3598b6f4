"""Recorded references: a byte-stable format, clear errors, a guarded recorder, the upgrade hook."""

import json

import numpy as np
import pytest

from conformance import families
from conformance.cli.record import main as record_main
from conformance.core.failure import CheckFailure
from conformance.core.references import (
    ARRAYS,
    MANIFEST,
    Reference,
    ReferenceError,
    directory,
    encode,
    extend,
    read,
    references_root,
    write,
)
from conformance.core.sharding import parse_mesh
from conformance.runtime.recorded import MissingReference, load
from conformance.runtime.recording import record
from conformance_models import GOLDENS
from conformance_models.gpt3.family import Gpt3Family
from tests.contract.toyzoo.stacked import ToyStacked
from tests.suite_run import run_check

SMALL = Reference(
    {"family": "toy", "versions": {"jax": "0"}},
    {
        "a/kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
        "loss": np.float32(1.5) * np.ones((), np.float32),
        "tokens": np.arange(4, dtype=np.int32),
    },
)


def test_encoding_is_byte_stable_and_round_trips(tmp_path):
    assert encode(SMALL) == encode(SMALL)
    write(tmp_path, SMALL)
    again = read(tmp_path)
    assert again.manifest == SMALL.manifest
    assert set(again.arrays) == set(SMALL.arrays)
    for name, array in SMALL.arrays.items():
        assert again.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(again.arrays[name], array)


def test_bfloat16_is_refused_not_silently_converted():
    import jax.numpy as jnp

    bad = Reference({}, {"x": np.ones(2, jnp.bfloat16)})
    with pytest.raises(ReferenceError, match="x: dtype bfloat16 cannot be recorded"):
        encode(bad)


def test_damaged_files_are_one_line_errors(tmp_path):
    with pytest.raises(ReferenceError, match="no recorded reference here"):
        read(tmp_path)
    write(tmp_path, SMALL)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["arrays"]["loss"] = manifest["arrays"]["loss"].replace("sha256:", "sha256:0")
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ReferenceError, match="loss does not match its manifest entry"):
        read(tmp_path)
    write(tmp_path, SMALL)
    data = bytearray((tmp_path / ARRAYS).read_bytes())
    (tmp_path / ARRAYS).write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ReferenceError, match=f"{ARRAYS}: unreadable") as caught:
        read(tmp_path)
    assert "\n" not in str(caught.value)
    (tmp_path / ARRAYS).unlink()
    with pytest.raises(ReferenceError, match="missing beside its manifest"):
        read(tmp_path)


def test_a_missing_reference_says_how_to_record_it(tmp_path):
    with pytest.raises(MissingReference) as caught:
        load(families.get("gpt3"), "linen", tmp_path)
    assert "python -m conformance.record --family gpt3 --backend linen" in str(caught.value)


def test_a_reference_of_another_family_is_refused(tmp_path):
    write(directory(tmp_path, "gpt3", "linen"), SMALL)
    with pytest.raises(MissingReference, match="manifest says"):
        load(families.get("gpt3"), "linen", tmp_path)


def test_the_recorder_never_replaces_changed_numbers_silently(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Gpt3Family, "goldens", None)  # kept in the project, as a zoo's are
    goldens = tmp_path / "goldens"
    where = directory(references_root(goldens), "gpt3", "linen")
    args = ["--family", "gpt3", "--goldens", str(goldens)]
    assert record_main(args) == 0
    assert capsys.readouterr().out.strip().endswith(": new")
    assert record_main(args) == 0
    assert capsys.readouterr().out.strip().endswith(": unchanged")
    manifest = json.loads((where / MANIFEST).read_text())
    manifest["versions"]["jax"] = "0.0.1"
    tampered = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    (where / MANIFEST).write_text(tampered)
    assert record_main(args) == 1
    assert "the recorded manifest changed; not written (rerun with --update" in (
        capsys.readouterr().out
    )
    assert (where / MANIFEST).read_text() == tampered
    assert record_main([*args, "--update"]) == 0
    assert capsys.readouterr().out.strip().endswith(": updated")
    full = read(where)
    older = {n: a for n, a in full.arrays.items() if not n.startswith("train_bfloat16/")}
    write(where, Reference(full.manifest, older))  # as an earlier harness recorded it
    assert record_main([*args, "--extend"]) == 0
    assert capsys.readouterr().out.strip().endswith(": extended")
    extended = read(where)
    assert extended.arrays.keys() == full.arrays.keys()
    assert [e["added"] for e in extended.manifest["extended"]] == [["train_bfloat16"]]
    assert record_main(["--family", "gpt3", "--backend", "nnx", "--goldens", str(goldens)]) == 2
    assert "would be unused" in capsys.readouterr().err
    assert not (where.parent / "nnx").exists()


def test_extending_adds_only_what_is_missing_and_keeps_every_recorded_number():
    params = {"params/w": np.ones(3, np.float32), "batch/tokens": np.arange(4, dtype=np.int32)}
    recorded = Reference(
        {"versions": {"jax": "old"}}, {**params, "train/1/loss": np.float32(2.0) * np.ones(())}
    )
    fresh = Reference(
        {"versions": {"jax": "new"}},
        {
            **params,
            "train/1/loss": np.float32(2.5) * np.ones(()),  # rounds otherwise on this machine
            "train_bfloat16/1/loss": np.float32(2.25) * np.ones(()),
        },
    )
    extended = extend(recorded, fresh)
    assert extended.arrays["train/1/loss"] == 2.0
    assert extended.arrays["train_bfloat16/1/loss"] == 2.25
    assert extended.manifest["versions"] == {"jax": "old"}
    assert extended.manifest["extended"] == [
        {"added": ["train_bfloat16"], "versions": {"jax": "new"}}
    ]
    assert extend(extended, fresh) is extended
    moved = Reference(fresh.manifest, {**fresh.arrays, "params/w": np.zeros(3, np.float32)})
    with pytest.raises(ReferenceError, match="record it again with --update"):
        extend(recorded, moved)


RENAMED = "layers/0/mlp/wi/kernel"
OLD_NAME = "layers/0/mlp/fc1/kernel"


def _renamed(name: str) -> str:
    return name.replace(RENAMED, OLD_NAME)


class Gpt3UpgradesOldName(Gpt3Family):
    """gpt3 whose reference came from a release that called its first MLP kernel ``fc1``."""

    def features(self):
        upgrading = families.Recorded(("linen",), self.upgrade_reference)
        return families.with_features(super().features(), upgrading)

    def upgrade_reference(self, leaves, versions):
        del versions
        return {path.replace(OLD_NAME, RENAMED): value for path, value in leaves.items()}


@pytest.fixture(scope="module")
def old_release(tmp_path_factory):
    """The gpt3 reference as an earlier release, with one parameter renamed, would hold it."""
    root = tmp_path_factory.mktemp("references")
    committed = read(directory(references_root(GOLDENS), "gpt3", "linen"))
    assert any(RENAMED in name for name in committed.arrays)
    arrays = {_renamed(name): value for name, value in committed.arrays.items()}
    write(directory(root, "gpt3", "linen"), Reference(committed.manifest, arrays))
    return root


@pytest.mark.parametrize("check", ["recorded_forward", "recorded_resume"])
def test_a_renamed_leaf_needs_the_upgrade_hook(old_release, tmp_path, check):
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    nnx = {"backend": "nnx"}
    with pytest.raises(CheckFailure, match=RENAMED):
        run_check(check, families.get("gpt3"), tmp_path, mesh, params=nnx, references=old_release)
    run_check(check, Gpt3UpgradesOldName(), tmp_path, mesh, params=nnx, references=old_release)


class StackedRecorded(ToyStacked):
    """toy-stacked keeping a recorded Linen reference: its stacked leaf is recorded split."""

    def features(self):
        return (*super().features(), families.Recorded(("linen",)))


GATE, UP = "blocks/0/gate/kernel", "blocks/0/up/kernel"


@pytest.fixture(scope="module")
def stacked_reference(tmp_path_factory):
    """toy-stacked's Linen reference, recorded through its Split rule."""
    root = tmp_path_factory.mktemp("references")
    family = StackedRecorded()
    write(directory(root, family.name, "linen"), record(family, "linen"))
    return family, root


RECORDED = [
    ("recorded_forward", None),
    ("recorded_train_step", None),
    ("recorded_resume", None),
    ("recorded_decode", None),
    ("recorded_quant_forward", "ptq_int8"),
]


@pytest.mark.parametrize("backend", ["linen", "nnx"])
@pytest.mark.parametrize(("check", "quant"), RECORDED)
def test_a_reference_recorded_through_a_split_replays_on_both_sides(
    stacked_reference, tmp_path, check, quant, backend
):
    family, root = stacked_reference
    recorded = read(directory(root, family.name, "linen")).arrays
    assert {f"params/{GATE}", f"params/{UP}"} <= set(recorded)
    assert not [name for name in recorded if "gate_up" in name]
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    params = {"backend": backend}
    run_check(check, family, tmp_path, mesh, quant=quant, params=params, references=root)


def test_a_reference_with_its_split_halves_swapped_fails_at_the_half(stacked_reference, tmp_path):
    family, root = stacked_reference
    committed = read(directory(root, family.name, "linen"))
    swapped = {f"train/1/grads/{GATE}": f"train/1/grads/{UP}"}
    swapped |= {new: old for old, new in swapped.items()}
    arrays = {name: committed.arrays[swapped.get(name, name)] for name in committed.arrays}
    faulty = tmp_path / "references"
    write(directory(faulty, family.name, "linen"), Reference(committed.manifest, arrays))
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    with pytest.raises(CheckFailure, match=GATE):
        run_check(
            "recorded_train_step",
            family,
            tmp_path,
            mesh,
            params={"backend": "nnx"},
            references=faulty,
        )
