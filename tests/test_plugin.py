"""The plugin's promises, checked by running pytest on a throwaway project."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from conformance.contract import Pair
from conformance.core.sharding import parse_mesh
from conformance.pytest_plugin.goldens import unused_goldens
from conformance.pytest_plugin.options import expand
from conformance.pytest_plugin.tiers import get_tier
from conformance_models.gpt3.family import Gpt3Family

GOLDEN_TEST = """
import json

import pytest


@pytest.mark.golden
def test_shape(family, scan_layers, golden):
    golden.check({"family": family.name, "scan": scan_layers, "value": VALUE})
"""


@pytest.fixture
def project(pytester):
    pytester.makeini("[pytest]\nconformance_goldens = goldens\n")

    def write(value=1):
        pytester.makepyfile(test_golden=GOLDEN_TEST.replace("VALUE", repr(value)))
        return pytester

    return write


def goldens(pytester):
    return sorted(str(p.relative_to(pytester.path)) for p in pytester.path.rglob("*.json"))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--conformance-family", "nope", "*unknown family 'nope'; known families: gpt3, llama*"),
        ("--conformance-mesh", "3x3", "*malformed mesh spec '3x3'; use 'axis=N*"),
        (
            "--conformance-tier",
            "nightly",
            "*unknown tier 'nightly'; valid tiers: smoke (*), default (*)*",
        ),
    ],
    ids=["unknown-family", "malformed-mesh", "unknown-tier"],
)
def test_bad_option_is_a_usage_error_naming_the_valid_values(pytester, option, value, message):
    result = pytester.runpytest(option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_missing_golden_fails_and_says_how_to_create_it(project):
    pytester = project()
    result = pytester.runpytest("--conformance-family", "gpt3")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*missing golden *goldens/gpt3/shape/loop.json*",
            "*regenerate with: python -m conformance --family gpt3 -m golden --snapshot-update "
            '--tier full -k "shape and loop"*',
        ]
    )
    result.stdout.no_fnmatch_line("*During handling of the above exception*")


def test_update_writes_goldens_then_they_pass(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update").assert_outcomes(
        passed=2
    )
    assert goldens(pytester) == ["goldens/gpt3/shape/loop.json", "goldens/gpt3/shape/scan.json"]
    pytester.runpytest("--conformance-family", "gpt3").assert_outcomes(passed=2)


def test_changed_value_fails_with_a_diff(project):
    project(1).runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = project(2).runpytest("--conformance-family", "gpt3")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(['*-*"value": 1*', '*+*"value": 2*'])


def test_corrupted_golden_fails_naming_the_file(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    (pytester.path / "goldens/gpt3/shape/scan.json").write_text('{"family": ')
    result = pytester.runpytest("--conformance-family", "gpt3")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*corrupted golden *goldens/gpt3/shape/scan.json*"])


@pytest.mark.parametrize("narrowing", [["-k", "loop"], ["test_golden.py::test_shape[gpt3-loop]"]])
def test_subset_update_never_deletes_other_goldens(project, narrowing):
    pytester = project(1)
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    pytester = project(2)
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update", *narrowing)
    assert goldens(pytester) == ["goldens/gpt3/shape/loop.json", "goldens/gpt3/shape/scan.json"]
    scan = (pytester.path / "goldens/gpt3/shape/scan.json").read_text()
    loop = (pytester.path / "goldens/gpt3/shape/loop.json").read_text()
    assert '"value": 1' in scan
    assert '"value": 2' in loop


def test_unused_golden_fails_the_run_and_is_not_deleted(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    stale = pytester.path / "goldens/gpt3/shape/renamed.json"
    stale.write_text("{}\n")
    for args in ([], ["-k", "loop"], ["--snapshot-update"]):
        result = pytester.runpytest("--conformance-family", "gpt3", *args)
        assert result.ret == pytest.ExitCode.TESTS_FAILED, args
        result.stdout.fnmatch_lines(["*unused goldens*", "*goldens/gpt3/shape/renamed.json"])
    assert stale.exists()


def test_node_id_selection_does_not_report_siblings_unused(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest(
        "--conformance-family", "gpt3", "test_golden.py::test_shape[gpt3-loop]"
    )
    assert result.ret == pytest.ExitCode.OK


def test_agreement_matrix_is_printed(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest("--conformance-family", "gpt3")
    result.stdout.fnmatch_lines(["*Linen/NNX agreement*", "check*gpt3", "shape*2/2"])


def test_quant_test_without_a_matching_mode_skips_naming_method_and_declared_modes(pytester):
    pytester.makepyfile(
        test_quant="""
import json

import pytest


@pytest.mark.quant_method("awq")
def test_awq(family, quant):
    raise AssertionError("must not run")
"""
    )
    result = pytester.runpytest("--conformance-family", "gpt3", "-rs")
    result.assert_outcomes(skipped=1)
    declared = "ptq_fp8, ptq_int8, qat_fp8, qat_int8"
    result.stdout.fnmatch_lines(
        [f"*gpt3 declares no awq quantization mode (it declares {declared})"]
    )


def test_smoke_tier_keeps_the_preferred_layout_and_claims_every_golden(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest("--conformance-family", "gpt3", "--conformance-tier", "smoke")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*conformance: tier smoke*"])
    assert "unused goldens" not in result.stdout.str()


def test_a_selection_that_empties_a_family_is_a_usage_error(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest(
        "--conformance-family", "gpt3", "--conformance-tier", "smoke", "-k", "scan"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["*tier 'smoke' and -k 'scan'*removed every test of gpt3*"])


def test_progress_prints_a_line_per_family_and_check(project):
    pytester = project()
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest("--conformance-family", "gpt3", "--conformance-progress", "-q")
    result.stdout.fnmatch_lines(
        [
            "*conformance: tier default*",
            "*2 tests to run",
            "*0/2   0%] gpt3 * shape * 1 passed (* s, then * s releasing compiled programs)",
        ]
    )


HOST_TEST = """
import os
import json

import pytest


def pytest_addoption(parser):
    parser.addoption("--family", default="mine")
    parser.addoption("--tier", default="mine")

@pytest.fixture
def family(request):
    return request.config.getoption("family")

def test_host_project(family):
    import jax
    assert family == "mine"
    assert "XLA_FLAGS" not in os.environ
    assert not jax.config.read("jax_disable_most_optimizations")
"""


def test_plugin_is_inert_in_a_run_that_does_not_select_the_suite(pytester, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    conftest, test = HOST_TEST.split("def test_host_project")
    pytester.makeconftest(conftest)
    pytester.makepyfile("import os\nimport pytest\n\ndef test_host_project" + test)
    result = pytester.runpytest_subprocess("-v")
    result.assert_outcomes(passed=1)
    assert "conformance:" not in result.stdout.str()
    assert "Linen/NNX agreement" not in result.stdout.str()


def test_builtin_families_can_be_left_out_by_ini(pytester):
    pytester.makeini("[pytest]\nconformance_builtin_families = false\n")
    pytester.makepyfile("def test_each(family):\n    pass\n")
    result = pytester.runpytest("--conformance-mesh", "fsdp=8")
    result.stdout.fnmatch_lines(["*conformance: families none;*"])
    result.assert_outcomes(skipped=1)  # pytest's "got empty parameter set"


@pytest.mark.parametrize(
    ("argv", "expanded"),
    [
        (["--tier", "smoke"], ["--conformance-tier=smoke"]),
        (["--family=llama", "-k", "forward"], ["--conformance-family=llama", "-k", "forward"]),
        (
            ["--progress", "--mesh", "fsdp=8"],
            ["--conformance-progress", "--conformance-mesh=fsdp=8"],
        ),
        (["--report", "/tmp", "tests"], ["--conformance-report=/tmp", "tests"]),
        (["--conformance-shared-dir", "."], ["--conformance-shared-dir=."]),
        (["--tier"], ["--conformance-tier"]),
        (["--report", "--progress"], ["--conformance-report", "--progress"]),
    ],
)
def test_main_takes_the_plugin_options_without_their_prefix(argv, expanded):
    assert expand(argv) == expanded


MEASURING_TEST = """
import numpy as np

from conformance.core.records import emit, measure

def test_measured(family):
    a = np.ones(2, np.float32)
    emit(measure("close", {"a": a}, {"a": a + np.float32(1e-6)}, figure="f", x="0"))

def test_planted(family):
    assert False, "planted failure"
"""


def test_the_report_carries_measurements_from_xdist_workers(pytester):
    pytester.makeini("[pytest]\nconformance_goldens = goldens\n")
    pytester.makepyfile(test_measuring=MEASURING_TEST)
    out = pytester.path / "out"
    args = ("--conformance-family", "gpt3", "-n", "2", "--conformance-report", str(out))
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = json.loads((out / "report.json").read_text())
    tests = {t["check"]: t for t in report["tests"]}
    assert tests["planted"]["outcome"] == "failed"
    assert "planted failure" in tests["planted"]["message"]
    (measured,) = tests["measured"]["measurements"]
    assert measured["passed"]
    assert 0 < measured["used"] < 1
    assert "| gpt3 | 1/1 | 0/1 (1f) |" in (out / "report.md").read_text()


def test_reference_of_other_versions_passes_and_an_undeclared_one_is_unused(pytester, monkeypatch):
    import shutil

    from conformance_models import GOLDENS
    from conformance_models.gpt3.family import Gpt3Family

    monkeypatch.setattr(Gpt3Family, "goldens", None)  # kept in the project, as a zoo's are
    pytester.makeini("[pytest]\nconformance_goldens = goldens\n")
    source = GOLDENS / "references/gpt3/linen"
    for backend in ("linen", "nnx"):
        shutil.copytree(source, pytester.path / f"goldens/references/gpt3/{backend}")
    manifest = pytester.path / "goldens/references/gpt3/linen/manifest.json"
    manifest.write_text(manifest.read_text().replace('"optax": "', '"optax": "0.0.1-was-'))
    result = pytester.runpytest(
        "--pyargs", "conformance.suite", "--conformance-family", "gpt3", "-k", "recorded_forward"
    )
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*gpt3: Linen and NNX vs recorded Linen (flax *, jax *) [versions differ: optax "
            "0.0.1-was-* -> *]*",
            "*unused goldens*",
            "*goldens/references/gpt3/nnx/manifest.json",
        ]
    )
    assert "gpt3/linen" not in result.stdout.str().split("unused goldens")[-1]
    assert (pytester.path / "goldens/references/gpt3/nnx/manifest.json").exists()


def test_a_platform_keyed_golden_of_another_platform_is_not_unused(tmp_path):
    config = SimpleNamespace(args=["conformance"], getoption=lambda name: None)
    cost = tmp_path / "gpt3" / "cost"
    mine = cost / "cpu-xla-low" / "data2-fsdp2-tensor2-loop.json"
    theirs = cost / "tpu-xla-full" / "data2-fsdp2-tensor2-loop.json"
    stale = cost / "cpu-xla-low" / "fsdp8-loop.json"
    gone = tmp_path / "mistral" / "cost" / "cpu-xla-low" / "data2-fsdp2-tensor2-loop.json"
    for path in (mine, theirs, stale, gone):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
    assert unused_goldens(config, tmp_path, {mine}, {"gpt3"}) == [stale, gone]


def test_a_run_of_named_tpu_slices_judges_no_golden_unused(tmp_path):
    golden = tmp_path / "gpt3" / "tpu_compile" / "libtpu-0.0.50.1-xla-full"
    mine, other = golden / "tiny-v6e-2x4-loop.json", golden / "6b-v5p-4x4x4-scan.json"
    for path in (mine, other):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")

    def run(*tpu):
        config = SimpleNamespace(
            args=["conformance"], getoption=lambda name: list(tpu) if "tpu" in name else None
        )
        return unused_goldens(config, tmp_path, {mine}, {"gpt3"})

    assert run("v6e:2x4") == []
    assert run("default") == [other]


def test_goldens_of_another_release_are_not_unused(tmp_path):
    config = SimpleNamespace(args=["conformance"], getoption=lambda name: None)
    family = tmp_path / "maxtext-gpt3"
    mine = family / "0.2.5" / "structure" / "tiny-scan.json"
    theirs = family / "0.2.4" / "structure" / "tiny-scan.json"
    stale = family / "0.2.5" / "structure" / "tiny-loop.json"
    for path in (mine, theirs, stale):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
    assert unused_goldens(config, tmp_path, {mine}, {"maxtext-gpt3"}) == [stale]


COMPILING_TEST = """
import jax


def test_compiles(family):
    assert float(jax.jit(lambda x: x * 2.0)(1.5)) == 3.0
"""


def test_an_xdist_run_reports_as_one_process_does(project):
    pytester = project()
    pytester.makepyfile(test_compiling=COMPILING_TEST)
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update")
    stray = next(pytester.path.rglob("*.json")).with_name("gone.json")
    stray.write_text("{}")
    args = ("--conformance-family", "gpt3", "--conformance-progress", "-q", "-n", "2")
    result = pytester.runpytest(*args, "--dist", "loadgroup")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*conformance: tier default*",
            "*conformance: 3 tests to run on xdist workers",
            "*] gpt3 * shape * 1 passed (* s on gw*, then * s releasing compiled programs)",
            "*programs compiled, * distinct*(summed over 2 workers)*",
            "*unused goldens*",
            f"*{stray.name}",
        ]
    )


@pytest.mark.parametrize(
    ("argv", "added"),
    [
        (["--tier", "smoke"], []),
        (["-n", "2"], ["--dist", "loadgroup"]),
        (["-n2"], ["--dist", "loadgroup"]),
        (["--numprocesses=auto"], ["--dist", "loadgroup"]),
        (["-n", "2", "--dist", "load"], []),
        (["-n", "2", "--dist=worksteal"], []),
    ],
)
def test_main_keeps_a_group_on_one_worker_unless_told_otherwise(argv, added):
    from conformance.cli.run import whole_groups

    assert whole_groups(argv) == added


GROUPED_TEST = """
import pytest


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(family, i):
    pass
"""


def test_a_group_runs_on_one_xdist_worker(pytester):
    pytester.makeini("[pytest]\nconformance_goldens = goldens\n")
    pytester.makepyfile(test_grouped=GROUPED_TEST)
    args = ("--conformance-family", "gpt3", "-n", "2", "--dist", "loadgroup", "-v")
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=6)
    lines = [line for line in result.stdout.lines if "PASSED" in line]
    assert len({line.split()[0] for line in lines}) == 1, lines
    assert all(line.rstrip().endswith("@together") for line in lines), lines


ERRING_TEST = """
import pytest


@pytest.fixture
def leaves_a_mess():
    yield
    raise RuntimeError("teardown broke")


def test_tidy(family, leaves_a_mess):
    pass


@pytest.mark.xfail(reason="thought broken", strict=False)
def test_lucky(family):
    pass
"""


def test_progress_lines_and_the_matrix_count_outcomes_as_pytest_does(pytester):
    """A teardown error is an error and an unexpected pass is xpassed, in every count."""
    pytester.makepyfile(test_erring=ERRING_TEST)
    args = (
        "--conformance-family",
        "gpt3",
        "--conformance-tier",
        "full",
        "--conformance-progress",
        "-q",
    )
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1, errors=1, xpassed=1)
    result.stdout.fnmatch_lines(
        [
            "*] gpt3 * tidy *1 error, 1 passed (* s)",
            "*] gpt3 * lucky *1 xpassed (* s, then * s releasing compiled programs)",
            "*Linen/NNX agreement (agreed/run; f=failed e=error s=skipped x=xfailed X=xpassed)*",
            "check*gpt3",
            "lucky*- (1X)",
            "tidy*0/1 (1e)",
        ]
    )


def test_the_default_tier_runs_bfloat16_on_its_primary_mesh_only():
    family = Gpt3Family()
    primary, other = parse_mesh("data=2,fsdp=2,tensor=2"), parse_mesh("fsdp=8")
    default, full = get_tier("default"), get_tier("full")
    assert default.leaves_out(family, {"mesh": primary, "dtype": "bf16"}) == ""
    assert default.leaves_out(family, {"mesh": other, "dtype": "f32"}) == ""
    assert default.leaves_out(family, {"mesh": other, "dtype": "bf16"}) == (
        "dtype bf16 on mesh fsdp8 (only on the primary mesh, data2-fsdp2-tensor2)"
    )
    assert full.leaves_out(family, {"mesh": other, "dtype": "bf16"}) == ""
    given = dataclasses.replace(default, meshes=None)
    assert given.leaves_out(family, {"mesh": other, "dtype": "bf16"}) == "", "--mesh keeps all"


def test_the_default_tier_runs_variant_checks_on_its_primary_mesh_only():
    family = Gpt3Family()
    primary, other = parse_mesh("data=2,fsdp=2,tensor=2"), parse_mesh("fsdp=8")
    default, full = get_tier("default"), get_tier("full")
    assert default.leaves_out(family, {"mesh": primary, "variant": True}) == ""
    assert default.leaves_out(family, {"mesh": other, "variant": False}) == ""
    assert default.leaves_out(family, {"mesh": other, "variant": True}) == (
        "variant check on mesh fsdp8 (only on the primary mesh, data2-fsdp2-tensor2)"
    )
    assert full.leaves_out(family, {"mesh": other, "variant": True}) == ""
    given = dataclasses.replace(default, meshes=None)
    assert given.leaves_out(family, {"mesh": other, "variant": True}) == "", "--mesh keeps all"


def test_the_default_tier_runs_variants_and_mode_pairs_in_the_preferred_layout_only():
    family = Gpt3Family()
    default, full = get_tier("default"), get_tier("full")
    assert default.leaves_out(family, {"scan_layers": False, "mode_pair": True}) == ""
    assert default.leaves_out(family, {"scan_layers": True, "mode_pair": False}) == ""
    assert default.leaves_out(family, {"scan_layers": True, "mode_pair": True}) == (
        "mode pair in layout scan (only in loop)"
    )
    assert default.leaves_out(family, {"scan_layers": False, "variant": True}) == ""
    assert default.leaves_out(family, {"scan_layers": True, "variant": True}) == (
        "variant check in layout scan (only in loop)"
    )
    assert full.leaves_out(family, {"scan_layers": True, "mode_pair": True}) == ""
    assert full.leaves_out(family, {"scan_layers": True, "variant": True}) == ""


@pytest.mark.parametrize("name", ["aqt_serve", "grad_accumulation", "explicit_sharding"])
def test_the_default_tier_plans_variants_and_mode_pairs_in_one_layout(name):
    """With or without a mesh axis, a variant or mode pair keeps the preferred layout."""
    from conformance.checks.registry import BUILTIN
    from conformance.core.roots import Goldens
    from conformance.pytest_plugin.plan import plan
    from conformance.pytest_plugin.session import Settings

    family, tier = Gpt3Family(), get_tier("default")
    mesh = parse_mesh("data=2,fsdp=2,tensor=2")
    run = Settings((family,), (mesh,), (), tier, "low", Goldens(None))
    kept = [p for p in plan(BUILTIN[name], family, run) if not tier.leaves_out(family, p.facets())]
    assert kept, name
    assert {p.values["scan_layers"] for p in kept} == {False}


def test_the_default_tier_runs_the_pair_axis_modes_as_smoke_does():
    """A check's mode-pair tests: primary mesh, preferred layout, float32; Linen vs NNX all."""
    from conformance.checks.registry import BUILTIN
    from conformance.core.roots import Goldens
    from conformance.pytest_plugin.plan import plan
    from conformance.pytest_plugin.session import Settings

    family, tier = Gpt3Family(), get_tier("default")
    meshes = (parse_mesh("data=2,fsdp=2,tensor=2"), parse_mesh("fsdp=8"))
    run = Settings((family,), meshes, (), tier, "low", Goldens(None))
    planned = plan(BUILTIN["forward"], family, run)
    kept = [p for p in planned if not tier.leaves_out(family, p.facets())]
    modes = [p for p in kept if p.values["pair"] != Pair.LINEN_NNX]
    assert sorted(p.id for p in modes) == [
        "gpt3-data2-fsdp2-tensor2-loop-f32-auto-vs-explicit",
        "gpt3-data2-fsdp2-tensor2-loop-f32-graph-vs-tree",
    ]
    assert len(kept) - len(modes) == 6, "Linen vs NNX: both meshes and layouts, bf16 on one"
    full = get_tier("full")
    assert not [p for p in planned if full.leaves_out(family, p.facets())]
    assert {p.row for p in modes} == {"forward graph-vs-tree", "forward auto-vs-explicit"}


@pytest.mark.parametrize("name", ["cost", "activation_sharding", "resume_conversion"])
def test_the_smoke_tier_leaves_the_costly_mode_pairs_to_default(name):
    """Their Linen-vs-NNX tests run in smoke; their mode pairs only from ``default`` on."""
    from conformance.checks.registry import BUILTIN
    from conformance.core.roots import Goldens
    from conformance.pytest_plugin.plan import plan
    from conformance.pytest_plugin.session import Settings

    family, mesh = Gpt3Family(), parse_mesh("data=2,fsdp=2,tensor=2")
    kept = {}
    for tier in (get_tier("smoke"), get_tier("default")):
        run = Settings((family,), (mesh,), (), tier, "low", Goldens(None))
        planned = plan(BUILTIN[name], family, run)
        kept[tier.name] = {p.pair for p in planned if not tier.leaves_out(family, p.facets())}
        reasons = {tier.leaves_out(family, p.facets()) for p in planned}
        if tier.name == "smoke":
            assert "mode pair compiling programs of its own (in the default tier)" in reasons
    assert kept == {"smoke": {Pair.LINEN_NNX}, "default": set(Pair)}


def test_costly_mode_pairs_are_the_probed_cost_analysed_and_resumed_ones():
    from conformance.checks.registry import BUILTIN

    assert {name for name, check in BUILTIN.items() if check.costly_pairs} == {
        "activation_sharding",
        "cost",
        "resume_conversion",
    }


def test_mode_pairs_are_the_checks_comparing_two_modes_of_nnx():
    from conformance.checks.registry import BUILTIN

    assert {name for name, check in BUILTIN.items() if check.mode_pair} == {
        "explicit_sharding",
        "tree_mode",
    }


def test_variant_checks_are_the_quantized_accumulated_and_tiled_ones():
    from conformance.checks.registry import BUILTIN

    variants = {name for name, check in BUILTIN.items() if check.variant}
    assert variants == {
        "aqt_convert",
        "aqt_forward",
        "aqt_serve",
        "aqt_train_step",
        "bf16_train_step",
        "fp8_train_step",
        "grad_accumulation",
        "qat_train_step",
        "quant_checkpoint",
        "quant_forward",
        "vocab_tiling",
    }
