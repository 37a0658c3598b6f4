"""Checkpoint directories: strict restore, bad input, and the converter command."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conformance import families
from conformance.cli.convert import main as convert_main
from conformance.core import programs
from conformance.core.trees import LeafSpec, specs
from conformance.runtime.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    expected_layout,
    read_info,
    restore,
    save,
)
from conformance.runtime.train_state import flat_state
from conformance.runtime.training import linen_trainer

INFO = CheckpointInfo("llama", "tiny", "linen", False)


@pytest.fixture(scope="module")
def llama_state():
    family = families.get("llama")
    trainer = linen_trainer(family, family.config("tiny", scan_layers=False))
    return flat_state(trainer.initial_state(trainer.runner.init(0)))


@pytest.fixture
def checkpoint(tmp_path, llama_state):
    path = tmp_path / "ckpt"
    save(path, llama_state, INFO)
    return path


def test_save_refuses_an_existing_directory(checkpoint, llama_state):
    with pytest.raises(CheckpointError, match="already exists"):
        save(checkpoint, llama_state, INFO)


def test_restore_is_exact(checkpoint, llama_state):
    restored = restore(checkpoint, specs(llama_state))
    for path, value in llama_state.items():
        assert np.asarray(restored[path]).tobytes() == np.asarray(value).tobytes(), path


def test_a_replicated_array_is_saved_without_compiling(tmp_path):
    """In one process one replica writes each shard: no slicing program per device."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    value = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    state = {"w": jax.device_put(value, NamedSharding(mesh, PartitionSpec()))}
    before = programs.COUNTS.compiled + programs.COUNTS.reused
    save(tmp_path / "ckpt", state, INFO)
    assert programs.COUNTS.compiled + programs.COUNTS.reused == before
    assert (tmp_path / "ckpt" / "state" / "array_metadatas").is_dir()  # orbax's, kept
    restored = restore(tmp_path / "ckpt", specs(state))
    assert np.asarray(restored["w"]).tobytes() == value.tobytes()


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint directory at .*nowhere"):
        read_info(tmp_path / "nowhere")


def test_corrupted_info_is_named(checkpoint):
    (checkpoint / "conformance.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"conformance\.json is corrupted"):
        read_info(checkpoint)


def test_truncated_checkpoint_is_an_error_not_a_traceback(checkpoint, llama_state):
    for path in (checkpoint / "state").rglob("*"):
        if path.is_file() and path.name != "_CHECKPOINT_METADATA":
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="cannot re"):
        restore(checkpoint, specs(llama_state))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("rename", "model/final_norm/norm: in the target, missing from the checkpoint"),
        ("drop", "model/final_norm/scale: in the checkpoint, not in the target"),
        ("shape", "model/final_norm/scale: checkpoint float32[64] != target float32[32]"),
        ("dtype", "model/final_norm/scale: checkpoint float32[64] != target bfloat16[64]"),
    ],
)
def test_strict_restore_names_the_leaf(checkpoint, llama_state, change, message):
    target = specs(llama_state)
    leaf = target.pop("model/final_norm/scale")
    if change == "rename":
        target["model/final_norm/norm"] = leaf
    elif change == "shape":
        target["model/final_norm/scale"] = LeafSpec((32,), leaf.dtype)
    elif change == "dtype":
        target["model/final_norm/scale"] = LeafSpec(leaf.shape, "bfloat16")
    with pytest.raises(CheckpointError) as err:
        restore(checkpoint, target)
    assert message in str(err.value)


def test_checkpoint_of_another_size_is_refused(tmp_path, llama_state):
    wrong = tmp_path / "wrong"
    save(wrong, llama_state, CheckpointInfo("llama", "tiny", "linen", True))
    assert convert_main([str(wrong), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_converter_round_trip_never_writes_the_source(checkpoint, tmp_path, capsys):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint.rglob("*"))
    assert convert_main([str(checkpoint), str(tmp_path / "nnx"), "--layout", "scan"]) == 0
    assert read_info(tmp_path / "nnx") == CheckpointInfo("llama", "tiny", "nnx", True)
    assert convert_main([str(tmp_path / "nnx"), str(tmp_path / "back"), "--layout", "loop"]) == 0
    assert "linen/loop" in capsys.readouterr().out
    original = restore(
        checkpoint,
        expected_layout(
            families.get("llama"), families.get("llama").config("tiny", scan_layers=False), "linen"
        ),
    )
    back = restore(tmp_path / "back", specs(original))
    assert all(
        np.asarray(back[p]).tobytes() == np.asarray(v).tobytes() for p, v in original.items()
    )
    assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint.rglob("*")) == before


@pytest.mark.parametrize("destination", ["existing", "inside"])
def test_converter_refuses_unsafe_destinations(checkpoint, tmp_path, destination, capsys):
    target = tmp_path if destination == "existing" else checkpoint / "sub"
    assert convert_main([str(checkpoint), str(target)]) == 2
    assert "error:" in capsys.readouterr().err


def test_unknown_family_in_checkpoint_lists_known_ones(checkpoint, tmp_path, capsys):
    info = json.loads((checkpoint / "conformance.json").read_text())
    info["family"] = "mistral"
    (checkpoint / "conformance.json").write_text(json.dumps(info))
    assert convert_main([str(checkpoint), str(tmp_path / "out")]) == 2
    assert "unknown family 'mistral'; known families: gpt3, llama" in capsys.readouterr().err


def test_converter_help_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "conformance.convert", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--to {auto,linen,nnx}" in out
