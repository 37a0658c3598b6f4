"""The report files: produced for a run with one planted failure, merged across processes.

Two processes write into one report directory, as ``make test`` does: one runs a
family with a planted fault (NNX's rotary base differs, so the forward diverges from
block 0 on and training follows), the other a correct family. The merged report must
validate against the schema, hold the failure's mismatches and plots, keep the
passing comparisons' headroom, and its HTML page must render in a headless browser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.checks import registry
from conformance.core.cost import Cost
from conformance.core.failure import CheckFailure
from conformance.core.numerics import Mismatch, Tolerance
from conformance.core.records import (
    Costs,
    Measurement,
    collecting,
    emit,
    error_stats,
    failed,
    measure,
)
from conformance.core.scope import Scope
from conformance.pytest_plugin.progress import covered
from conformance.report import plots, render, tables
from conformance.report.model import (
    SCHEMA_PATH,
    RecordedTest,
    ReportError,
    costs_json,
    matrix_rows,
    measurement_json,
    merge,
    time_by_area,
    write_part,
)
from conformance.runtime.case import Case
from tests.faults.forward import RopeBase
from tests.faults.installed import FAULTY, install_faulty_family

REPO = Path(__file__).parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def run_suite(project: Path, site: Path, report: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "conformance", "--tier", "smoke", "--report", str(report)]
    return subprocess.run(
        [*command, *args], cwd=project, env=env, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    site, project, report = root / "site", root / "project", root / "out"
    site.mkdir()
    project.mkdir()
    install_faulty_family(site)
    (project / "pytest.ini").write_text("[pytest]\nconformance_goldens = goldens\n")
    faulty = run_suite(
        project, site, report, "--family", FAULTY, "-k", "test_forward and not finite and not vs"
    )
    assert faulty.returncode == 1, faulty.stdout[-5000:] + faulty.stderr[-3000:]
    assert "conformance report:" in faulty.stdout
    correct = run_suite(
        project, site, report, "--family", "gpt3", "-k", "test_forward and not finite and not vs"
    )
    assert correct.returncode == 0, correct.stdout[-5000:] + correct.stderr[-3000:]
    return report


def test_the_report_merges_both_processes_and_validates(report_dir):
    jsonschema = pytest.importorskip("jsonschema")
    report = json.loads((report_dir / "report.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    assert len(report["runs"]) == 2
    assert {r["families"][0] for r in report["runs"]} == {FAULTY, "gpt3"}
    outcomes = {(t["family"], t["check"]): t["outcome"] for t in report["tests"]}
    assert outcomes == {(FAULTY, "forward"): "failed", ("gpt3", "forward"): "passed"}


def test_the_failure_carries_its_mismatches_and_where_it_starts(report_dir):
    report = json.loads((report_dir / "report.json").read_text())
    (failure,) = [t for t in report["tests"] if t["outcome"] == "failed"]
    assert failure["message"].startswith(f"{FAULTY} forward:")
    failing = [m for m in failure["measurements"] if not m["passed"]]
    assert failing[0]["x"] == "block 0", "the rotary base changes block 0's attention"
    leaf = failing[0]["mismatches"][0]
    assert leaf["path"] == "hidden_states[0]"
    assert leaf["first"] != leaf["second"]
    assert leaf["tolerance"] == {"atol": 1e-5, "rtol": 1.3e-6}


def test_the_failure_has_a_plot_and_passes_keep_their_headroom(report_dir):
    pngs = sorted((report_dir / "plots").glob("*.png"))
    assert pngs
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert any(FAULTY in p.name and "forward" in p.name for p in pngs)
    markdown = (report_dir / "report.md").read_text()
    assert "## Headroom of agreeing comparisons" in markdown
    assert "| gpt3 | forward |" in markdown
    assert f"### {FAULTY} forward" in markdown


def test_junit_lists_both_processes_tests(report_dir):
    suite = ET.parse(report_dir / "junit.xml").getroot().find("testsuite")
    assert suite.get("tests") == "2"
    assert suite.get("failures") == "1"
    (failure,) = suite.iter("failure")
    assert FAULTY in failure.get("message")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_html_page_renders_the_matrix_in_a_headless_browser(report_dir, tmp_path):
    page = (report_dir / "report.html").resolve().as_uri()
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*browser, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert '<table id="matrix">' in dom
    assert FAULTY in dom
    assert dom.count("data:image/png;base64,") >= 1
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*browser, f"--screenshot={shot}", "--window-size=1200,900", page],
        capture_output=True,
        timeout=120,
        check=True,
    )
    matplotlib_image = pytest.importorskip("matplotlib.image")
    pixels = matplotlib_image.imread(shot)
    assert pixels.shape[:2] == (900, 1200)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20, "a blank page"


def test_error_stats_measure_the_share_of_the_tolerance_used():
    tol = Tolerance(1e-5, 1e-2)
    max_abs, max_rel, used = error_stats(np.array([1.0, 2.0]), np.array([1.0, 2.01]), tol)
    assert max_abs == pytest.approx(0.01)
    assert max_rel == pytest.approx(0.01 / 2.01)
    assert used == pytest.approx(0.01 / (1e-5 + 1e-2 * 2.01))
    assert error_stats(np.array([np.nan]), np.array([1.0]), tol)[2] == float("inf")
    assert error_stats(np.array([np.nan]), np.array([np.nan]), tol) == (0.0, 0.0, 0.0)


def test_measurements_go_only_to_a_collecting_block():
    m = measure("t", {"a": np.zeros(3)}, {"a": np.zeros(3)})
    emit(m)  # nobody listens: dropped
    with collecting() as found:
        emit(m)
        text = failed("t2", [_mismatch()])
    assert [x.title for x in found] == ["t", "t2"]
    assert found[0].passed
    assert not found[1].passed
    assert text.startswith("t2: 1 leaf(s) disagree")


def _mismatch() -> Mismatch:
    return Mismatch("w", (0,), 1.0, 2.0, 1, 4, 1.0, 0.5, Tolerance(1e-5, 1.3e-6))


def _record(nodeid: str, outcome: str, message: str = "x" * 100) -> RecordedTest:
    bad = Measurement(
        "t",
        ("Linen", "NNX"),
        1.0,
        0.5,
        9.0,
        Tolerance(1e-5, 0),
        "f",
        "s",
        "block 1",
        (_mismatch(),),
    )
    good = Measurement(
        "t", ("Linen", "NNX"), 0.0, 0.0, 0.0, Tolerance(1e-5, 0), "f", "s", "block 0"
    )
    return RecordedTest(
        nodeid,
        "fam",
        "forward",
        "case",
        outcome,
        1.0,
        message,
        [measurement_json(good), measurement_json(bad)],
    )


def test_a_rerun_of_one_command_replaces_its_part(tmp_path):
    run = {"command": ["a"], "started": "1"}
    write_part(tmp_path, run, [_record("t::a[fam-case]", "failed")])
    write_part(tmp_path, run, [_record("t::a[fam-case]", "passed")])
    write_part(tmp_path, {"command": ["b"], "started": "2"}, [_record("t::b[fam-x]", "passed")])
    report = merge(tmp_path)
    assert [t["outcome"] for t in report["tests"]] == ["passed", "passed"]
    assert report["summary"]["passed"] == 2


def test_markdown_stays_under_its_limit():
    report = {
        "runs": [],
        "summary": {"failed": 500},
        "tests": [_record(f"t::x{i}[fam-c]", "failed", "y" * 5000).to_json() for i in range(500)],
    }
    text = render.markdown(report, limit=100_000)
    assert len(text.encode()) <= 100_000
    assert "more failure(s): see report.json" in text


def test_the_plot_marks_the_first_divergent_point():
    ms = [_record("t::x", "failed").measurements[i] for i in (0, 1)]
    assert plots.first_divergent(ms) == "block 1"
    assert plots.plot_png("f", ms).startswith(b"\x89PNG")


def test_a_corrupt_part_is_named(tmp_path):
    write_part(tmp_path, {"command": ["a"], "started": "1"}, [])
    bad = tmp_path / "parts" / "bad.json"
    bad.write_text("{truncated")
    with pytest.raises(ReportError, match=r"bad\.json"):
        merge(tmp_path)
    bad.write_text("[]")
    with pytest.raises(ReportError, match="not a report part"):
        merge(tmp_path)


def test_a_failing_train_step_measures_every_step(primary_mesh):
    mesh, devices = primary_mesh
    case = Case.of(RopeBase(), scan_layers=False, mesh=mesh, devices=devices)
    with Scope(), collecting() as found, pytest.raises(CheckFailure, match="step 1 of 3"):
        registry.get("train_step")(case)
    steps = {m.series for m in found}
    assert steps == {"step 1", "step 2", "step 3"}, "later steps are measured too"
    failing = [m for m in found if not m.passed]
    assert failing[0].series == "step 1"
    assert {m.x for m in failing} >= {"loss"}, "the loss moves when the rotary base does"


def _costed(
    check: str, case: str, program: str, linen: dict, nnx_: dict, keys=("linen", "nnx")
) -> dict:
    """A report of one passed test of ``check`` whose program cost ``linen`` and ``nnx_``."""
    record = RecordedTest(f"t::test_{check}[fam-{case}]", "fam", check, case)
    record.costs = [costs_json(Costs(program, dict(zip(keys, (linen, nnx_), strict=True))))]
    return {"runs": [], "summary": {"passed": 1}, "tests": [record.to_json()]}


def test_the_cost_table_shows_nnx_against_linen():
    linen = Cost(100.0, 1000.0, 400, 40, 200, 0, {"all-gather": (2, 64)}).table()
    report = _costed("cost", "loop", "train_step", linen, {**linen, "temp_bytes": 230})
    markdown = render.markdown(report)
    assert "## Compiled cost (NNX, or the second mode of a mode pair, and its ratio" in markdown
    assert "| fam | loop | train_step | 100 (1.000x) | 1,000 (1.000x) | 400 (1.000x) | " in markdown
    assert "230 (1.150x) | same: all-gather x2 |" in markdown


def test_the_cost_table_shows_a_mode_against_the_mode_it_is_compared_with():
    graph = Cost(100.0, 1000.0, 400, 40, 200, 0, {"all-gather": (2, 64)}).table()
    tree = {**graph, "flops": 110.0, "collectives": {"all-reduce": {"count": 1, "bytes": 8}}}
    report = _costed(
        "cost", "loop-graph-vs-tree", "forward", graph, tree, ("nnx-graph", "nnx-tree")
    )
    markdown = render.markdown(report)
    assert "| fam | loop-graph-vs-tree | forward | 110 (1.100x) | " in markdown
    assert "| nnx-tree: all-reduce x1 |" in markdown


def test_the_tpu_memory_table_shows_each_side_per_device_against_the_chip():
    base = Cost(100.0, 1000.0, 400, 40, 200, 0, {}).table()
    linen = {**base, "footprint_bytes": 8 * 2**30, "hbm_bytes": 16 * 2**30}
    nnx_ = {**linen, "footprint_bytes": 12 * 2**30}
    report = _costed("tpu_compile", "8b-v5e", "forward on v5e:4x4", linen, nnx_)
    markdown = render.markdown(report)
    assert "## Memory per device, compiled for TPU" in markdown
    assert "| fam | 8b-v5e | forward on v5e:4x4 | 8.00 | 12.00 | 1.500x | 75% |" in markdown
    assert "Memory per device, compiled for TPU" in render.page(report, {})


def test_a_family_with_a_bridged_side_is_labelled_in_the_matrix():
    results = {("zoo-model", "forward"): {"passed": 2}, ("gpt3", "forward"): {"passed": 2}}
    rows = matrix_rows(results, {"zoo-model": ["Linen"]})
    assert [row[0] for row in rows] == ["family", "gpt3", "zoo-model (Linen bridged)"]


def test_a_test_is_reported_under_its_node_id_without_its_xdist_group():
    from conformance.report.model import plain_nodeid

    grouped = (
        "conformance/suite/test_forward.py::test_forward[gpt3-fsdp8-loop-f32]@gpt3/False/fsdp8"
    )
    assert plain_nodeid(grouped) == grouped.split("@")[0]
    assert plain_nodeid("tests/test_a.py::test_b[x@y]") == "tests/test_a.py::test_b[x@y]"
    assert plain_nodeid("tests/test_a.py::test_b@g") == "tests/test_a.py::test_b"


def test_time_goes_to_each_area_and_nested_traces_count_once():
    assert covered([(0.0, 3.0), (1.0, 2.0), (5.0, 6.0)]) == 4.0
    tests = [
        {"area": "training", "duration_s": 10.0, "compiles": 4, "compile_s": 6.0, "trace_s": 3.0},
        {"area": "training", "duration_s": 2.0, "compiles": 1, "compile_s": 1.0, "trace_s": 0.5},
        {"area": "structure", "duration_s": 1.0, "compiles": 0, "compile_s": 0.0, "trace_s": 1.5},
        {"area": None, "duration_s": 50.0},
    ]
    assert time_by_area(tests) == [
        {
            "area": "training",
            "tests": 2,
            "wall_s": 12.0,
            "trace_s": 3.5,
            "compile_s": 7.0,
            "run_s": 1.5,
            "compiles": 5,
        },
        {
            "area": "structure",
            "tests": 1,
            "wall_s": 1.0,
            "trace_s": 1.5,
            "compile_s": 0.0,
            "run_s": 0.0,
            "compiles": 0,
        },
    ]


def test_the_activation_tables_give_a_row_per_program_and_one_per_call():
    rows = [
        ["layers/0/mlp __call__", "P('data', None)", "P(None, None)"],
        ["(top) __call__", "P()", ""],
    ]
    test = {"family": "llama", "check": "activation_sharding", "case": "fsdp8-loop"}
    report = {"tests": [test | {"layouts": [{"program": "forward", "rows": rows}]}]}
    assert tables.layout_rows(report, calls=False)[1:] == [
        ["llama", "fsdp8-loop", "forward", "2", "1"]
    ]
    assert tables.layout_rows(report, calls=True)[1] == ["llama", "fsdp8-loop", "forward", *rows[0]]
