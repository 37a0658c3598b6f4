"""The release-upgrade section: golden changes between release folders, in the report."""

import json

import jsonschema

from conformance.cli import upgrade
from conformance.core.goldens import changes
from conformance.report import model, render


def test_changes_name_each_leaf_that_changed_appeared_or_went():
    old = {"a": {"shape": [4, 1], "dtype": "float32"}, "b": {"shape": [2]}, "c": 1}
    new = {"a": {"shape": [1, 4], "dtype": "float32"}, "c": 1, "d": {"shape": [3]}}
    assert changes(old, new) == [
        "a/shape: [4, 1] -> [1, 4]",
        'b: removed {"shape": [2]}',
        'd: added {"shape": [3]}',
    ]
    assert changes(old, old) == []


def _write(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_golden_changes_compare_every_earlier_release_with_the_installed_one(tmp_path):
    family = tmp_path / "zoo-model"
    _write(family / "1.0/structure/tiny.json", {"w": {"shape": [4, 1]}})
    _write(family / "1.1/structure/tiny.json", {"w": {"shape": [1, 4]}})
    _write(family / "1.0/sharding/fsdp8.json", {"w": ["fsdp"]})
    _write(family / "1.1/sharding/fsdp8.json", {"w": ["fsdp"]})
    _write(family / "1.0/decode_cache/tiny.json", {})
    _write(family / "1.1/cost/cpu-xla-low/fsdp8.json", {"flops": 1})
    found, same = upgrade.golden_changes(tmp_path, "zoo-model", "1.1")
    assert same == 1
    assert [(c["from"], c["golden"], c["change"], c["lines"]) for c in found] == [
        ("1.0", "cost/cpu-xla-low/fsdp8.json", "added", []),
        ("1.0", "decode_cache/tiny.json", "removed", []),
        ("1.0", "structure/tiny.json", "changed", ["w/shape: [4, 1] -> [1, 4]"]),
    ]


UPGRADE = {
    "family": "zoo-model",
    "release": "1.1",
    "goldens": [
        {"from": "1.0", "golden": "structure/tiny.json", "change": "changed", "lines": ["w: x"]}
    ],
    "unchanged_goldens": 3,
    "checkpoints": [
        {
            "backend": "nnx",
            "recorded_with": "recorded NNX (zoo 1.0)",
            "leaves": 10,
            "unchanged": 9,
            "moved": ["model/w: recorded Param float32[4, 1], live Bias float32[1, 4]"],
        }
    ],
}


def test_the_section_joins_the_report_files_beside_the_run_s_recorded_verdicts(tmp_path):
    run = model.header("default", ["fsdp8"], "low", ["zoo-model"])
    run |= {"command": ["conformance"], "started": "", "duration_s": 1.0, "exit_status": 0}
    test = model.RecordedTest(
        "suite.py::test_recorded_forward[zoo-model-x]", "zoo-model", "recorded_forward"
    )
    render.add_part(tmp_path, run, [test])
    report = render.add_part(tmp_path, run | {"command": ["upgrade"]}, [], [UPGRADE])
    jsonschema.validate(report, json.loads(model.SCHEMA_PATH.read_text()))
    text = (tmp_path / "report.md").read_text()
    section = text.split("## Release upgrade")[1].split("## Failures")[0]
    assert "### zoo-model: release 1.1" in section
    assert "- `structure/tiny.json` changed since 1.0" in section
    assert "Checkpoint of recorded NNX (zoo 1.0): 9 of 10 leaves unchanged:" in section
    assert "model/w: recorded Param float32[4, 1], live Bias float32[1, 4]" in section
    assert "Numbers against the recorded references: recorded_forward 1/1" in section
    assert "Release upgrade" in (tmp_path / "report.html").read_text()


def test_no_family_keeping_goldens_per_release_is_a_clear_error(capsys):
    assert upgrade.main(["--family", "gpt3"]) == 2
    assert "no selected family keeps its goldens per release" in capsys.readouterr().err


def test_an_unknown_family_is_a_clear_error(capsys):
    assert upgrade.main(["--family", "no-such-family"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_cost_golden_that_moved_leads_with_its_ratios():
    old = {"programs": {"forward": {"nnx": {"flops": 100.0, "bytes_accessed": 10.0}}}}
    new = {"programs": {"forward": {"nnx": {"flops": 213.0, "bytes_accessed": 10.0}}}}
    assert upgrade.cost_ratios(old, new) == ["forward nnx: flops 2.130x"]


def test_a_tpu_compile_golden_that_moved_leads_with_its_footprint_ratio(tmp_path):
    family = tmp_path / "zoo-model"
    golden = "tpu_compile/libtpu-0.0.50.1-xla-full/70b-v5p-4x4x4-data2-fsdp16-tensor2-scan.json"
    step = {"flops": 10.0, "temp_bytes": 4.0, "footprint_bytes": 8.0}
    _write(family / "1.0" / golden, {"programs": {"train_step (remat)": {"nnx": step}}})
    moved = step | {"footprint_bytes": 12.0}
    _write(family / "1.1" / golden, {"programs": {"train_step (remat)": {"nnx": moved}}})
    (change,), same = upgrade.golden_changes(tmp_path, "zoo-model", "1.1")
    assert same == 0
    assert change["lines"][0] == "train_step (remat) nnx: footprint_bytes 1.500x"
