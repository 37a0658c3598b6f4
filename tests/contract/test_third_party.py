"""The Family contract is the whole contract: a zoo written from the docs passes the suite.

``toyzoo`` is a third-party package (its own Linen and NNX modules, nothing from this
repository's built-in families) installed as a throwaway distribution whose entry
points register six families: ``toy-minimal`` declares no optional capability,
``toy-full`` declares layouts, remat, dropout, decode (MaxText's prefill style) and Qwix
QAT, ``toy-lm`` is written as Flax's examples are (decoding token by token through its
``decode_config``, logits that predict the current token), ``toy-moe`` is a mixture
of experts sharded on ``expert`` that sows a load-balancing loss, and ``toy-fn`` takes
and returns its KV cache as a value (a ``CacheAsValue``) and is quantized by Qwix PTQ;
``toy-stacked`` is ``toy-fn`` with two projections stacked in one Linen leaf, mapped to
two NNX kernels by a ``Split`` leaf transform.
Its ``conformance.checks`` entry point registers a check of its own, ``logits_bounded``.
The suite runs on all six at the smoke tier, in a fresh process, as a zoo's CI would:
the whole suite must pass, writing the zoo's goldens as it goes (``--snapshot-update``),
and every skip must carry a reason; a second run reads those goldens back (the ones that
compile nothing: the compiled ones differ from them only by a platform folder, which the
built-in families' goldens cover).
"""

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FAMILIES = ("toy-minimal", "toy-full", "toy-lm", "toy-moe", "toy-fn", "toy-stacked")
ENTRY_POINTS = """[conformance.families]
toy-minimal = toyzoo.families:ToyMinimal
toy-full = toyzoo.families:ToyFull
toy-lm = toyzoo.families:ToyLm
toy-moe = toyzoo.families:ToyMoe
toy-fn = toyzoo.families:ToyFn
toy-stacked = toyzoo.stacked:ToyStacked

[conformance.checks]
logits_bounded = toyzoo.checks:check_logits_bounded
"""


def install_zoo(site: Path) -> None:
    """``toyzoo`` as an installed distribution: the package and its ``.dist-info``."""
    shutil.copytree(HERE / "toyzoo", site / "toyzoo")
    info = site / "toyzoo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyzoo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)


def run_suite(
    project: Path, site: Path, junit: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site), **(env or {}))
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "pytest", "--pyargs", "conformance.suite", "-p"]
    command += ["no:cacheprovider", "-q", "-rs", f"--junitxml={junit}", "--conformance-tier=smoke"]
    command += [f"--conformance-family={name}" for name in FAMILIES]
    return subprocess.run(
        [*command, *args], cwd=project, env=env, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    site, project = root / "site", root / "project"
    site.mkdir()
    project.mkdir()
    install_zoo(site)
    (project / "pytest.ini").write_text(
        "[pytest]\nconformance_goldens = goldens\nconformance_builtin_families = false\n"
    )
    run = run_suite(project, site, root / "run.xml", "--snapshot-update")
    return run, ET.parse(root / "run.xml"), project


def test_the_zoos_goldens_are_read_back(zoo_run):
    _, _, project = zoo_run
    site = project.parent / "site"
    uncompiled = "not (cost or activation_sharding)"
    reread = run_suite(
        project, site, project.parent / "reread.xml", "-m", "golden", "-k", uncompiled
    )
    assert reread.returncode == 0, reread.stdout[-5000:] + reread.stderr[-3000:]
    cases = list(ET.parse(project.parent / "reread.xml").iter("testcase"))
    read = {c.get("name").split("[")[0] for c in cases if c.find("skipped") is None}
    assert {"test_structure", "test_sharding", "test_decode_cache", "test_quant_params"} <= read


def test_the_zoo_passes_the_whole_suite_with_zero_failures(zoo_run):
    run, junit, _ = zoo_run
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-3000:]
    cases = list(junit.iter("testcase"))
    failed = [
        c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None
    ]
    assert not failed
    for family in FAMILIES:
        ran = [c for c in cases if f"[{family}-" in c.get("name") and c.find("skipped") is None]
        assert ran, f"nothing of {family} ran"


def test_every_skip_names_the_family_and_why(zoo_run):
    _, junit, _ = zoo_run
    skips = {
        c.get("name"): s.get("message", "")
        for c in junit.iter("testcase")
        if (s := c.find("skipped")) is not None
    }
    assert skips, "toy-minimal declares nothing optional: some checks must skip"
    vague = {name: why for name, why in skips.items() if "toy-" not in why or len(why) < 30}
    assert not vague
    minimal = {name: why for name, why in skips.items() if "[toy-minimal-" in name}
    layout = [why for name, why in minimal.items() if "scan_layers" in why]
    assert layout
    assert all(why.endswith("never stacked") for why in layout), layout
    decode = [why for name, why in minimal.items() if name.startswith("test_decode[")]
    assert decode
    assert all(why.endswith("it keeps no KV cache") for why in decode), decode


def checks_run(junit: ET.ElementTree, family: str) -> set[str]:
    """The checks that ran (were not skipped) on ``family``, by name."""
    return {
        c.get("name").split("[")[0].removeprefix("test_")
        for c in junit.iter("testcase")
        if f"[{family}-" in c.get("name") and c.find("skipped") is None
    }


def test_the_minimal_zoo_skips_exactly_what_it_does_not_declare(zoo_run):
    _, junit, _ = zoo_run
    minimal = checks_run(junit, "toy-minimal")
    assert {"structure", "sharding", "forward", "train_step", "hygiene"} <= minimal
    assert not minimal & {"dropout", "decode", "aqt_forward", "quant_forward"}


def test_the_full_zoo_runs_what_it_declares(zoo_run):
    _, junit, _ = zoo_run
    full = checks_run(junit, "toy-full")
    declared = {"dropout", "layout", "decode_cache", "decode_consistency", "decode"}
    assert declared | {"quant_forward", "checkpoint_conversion"} <= full


def test_the_flax_style_zoo_decodes_token_by_token(zoo_run):
    _, junit, _ = zoo_run
    lm = checks_run(junit, "toy-lm")
    assert {"decode_cache", "decode_consistency", "decode", "train_step"} <= lm


def test_the_value_cache_zoo_decodes_and_quantizes(zoo_run):
    _, junit, project = zoo_run
    fn = checks_run(junit, "toy-fn")
    assert {"decode_cache", "decode_consistency", "decode", "quant_forward"} <= fn
    golden = next((project / "goldens" / "toy-fn" / "decode_cache").glob("*.json")).read_text()
    assert '"blocks/0/total"' in golden


def test_a_stacked_leaf_maps_to_two_kernels_through_every_check(zoo_run):
    _, junit, project = zoo_run
    stacked = checks_run(junit, "toy-stacked")
    compared = {"structure", "sharding", "init", "forward", "train_step", "optimizer_sharding"}
    quantized = {"quant_params", "quant_forward", "quant_checkpoint"}
    kept = {"checkpoint_conversion", "checkpoint_roundtrip", "decode", "decode_cache"}
    assert compared | quantized | kept <= stacked
    golden = (project / "goldens" / "toy-stacked" / "quant_params").glob("*.json")
    assert '"blocks/0/up/kernel/array/scale"' in next(golden).read_text()


def test_the_first_edition_zoo_is_shown_the_second_edition_spelling(zoo_run):
    run, _, _ = zoo_run
    assert (
        "FirstEditionWarning: family 'toy-lm' declares abilities in the first edition's "
        "spelling (Capabilities flags with hooks); list them in features(): "
        "Capabilities(decode=True, decode_style='token') with decode_config -> "
        "Decode(style='token', config=self.decode_config)"
    ) in run.stdout
    assert "FirstEditionWarning: family 'toy-fn'" not in run.stdout


def test_the_mixture_of_experts_trains_with_its_load_balancing_loss(zoo_run):
    _, junit, project = zoo_run
    assert {"aux_losses", "train_step", "sharding"} <= checks_run(junit, "toy-moe")
    golden = next((project / "goldens" / "toy-moe" / "sharding").glob("*.json")).read_text()
    assert '"expert"' in golden


def test_the_goldens_are_the_zoos_own(zoo_run):
    _, _, project = zoo_run
    written = {p.relative_to(project / "goldens").parts[:2] for p in project.rglob("*.json")}
    assert ("toy-minimal", "structure") in written
    assert ("toy-full", "sharding") in written
    assert not any(family in ("gpt3", "llama", "moe") for family, _ in written)


def test_the_zoos_own_check_runs_on_every_family(zoo_run):
    _, junit, _ = zoo_run
    for family in FAMILIES:
        assert "logits_bounded" in checks_run(junit, family), family


def zoo_project(root: Path) -> tuple[Path, Path]:
    """``(site, project)`` under ``root``: the zoo installed, a project without goldens."""
    site, project = root / "site", root / "project"
    site.mkdir()
    project.mkdir()
    install_zoo(site)
    (project / "pytest.ini").write_text("[pytest]\nconformance_builtin_families = false\n")
    return site, project


def test_the_zoos_own_check_fails_naming_the_side_and_the_bound(tmp_path):
    site, project = zoo_project(tmp_path)
    env = {"TOYZOO_LOGIT_BOUND": "1e-6"}
    run = run_suite(project, site, tmp_path / "run.xml", "-k", "logits_bounded", env=env)
    assert run.returncode == 1, run.stdout[-5000:] + run.stderr[-3000:]
    assert "toy-minimal logits_bounded: Linen logits reach |" in run.stdout
    assert "over the zoo's bound 1e-06" in run.stdout


def test_a_check_entry_point_that_is_not_a_check_is_a_usage_error(tmp_path):
    site, project = zoo_project(tmp_path)
    points = site / "toyzoo-0.1.dist-info" / "entry_points.txt"
    points.write_text(
        points.read_text().replace("checks:check_logits_bounded", "checks:LOGIT_BOUND")
    )
    run = run_suite(project, site, tmp_path / "run.xml", "--collect-only")
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]
    assert "check entry point 'logits_bounded' = 'toyzoo.checks:LOGIT_BOUND' gave float" in (
        run.stdout + run.stderr
    )
