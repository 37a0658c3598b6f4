"""Goldens are where the project says, whatever paths the command line holds.

pytest infers its rootdir and configuration file from the command line's existing paths
before it knows a plugin's options, so an option's value can move them. Each path-valued
option is run here with an existing and a missing directory, relative and absolute, as
pytest's command line and as ``python -m conformance`` takes it: the project's golden is
found where its configuration says, or the run stops with a one-line usage error before
any test. Nothing ever lands beside the project.
"""

from pathlib import Path

import pytest

from conformance.cli.run import emulation_parser
from conformance.core.roots import Goldens, GoldensError, installed, project_goldens
from conformance_models import GOLDENS
from conformance_models.gpt3.family import Gpt3Family
from tests.test_plugin import GOLDEN_TEST

EXPECTED = ["goldens/gpt3/shape/loop.json", "goldens/gpt3/shape/scan.json"]


@pytest.fixture
def project(pytester):
    """A project with a user's golden test on gpt3, its goldens written once."""
    pytester.makeini("[pytest]\nconformance_goldens = goldens\n")
    pytester.makepyfile(test_golden=GOLDEN_TEST.replace("VALUE", "1"))
    pytester.runpytest("--conformance-family", "gpt3", "--snapshot-update").assert_outcomes(
        passed=2
    )
    return pytester


def _json_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.json"))


def _directory(pytester, existing: bool, absolute: bool, outside: bool) -> str:
    """A directory argument: inside the project or beside it, existing or not."""
    base = pytester.path.parent / f"{pytester.path.name}-out" if outside else pytester.path / "out"
    if existing:
        base.mkdir(exist_ok=True)
    if absolute:
        return str(base)
    return str(Path("..", base.name) if outside else Path("out"))


CASES = [
    pytest.param(existing, absolute, outside, id=f"{e}-{a}-{o}")
    for existing, e in ((True, "existing"), (False, "missing"))
    for absolute, a in ((True, "absolute"), (False, "relative"))
    for outside, o in ((True, "outside"), (False, "inside"))
]


@pytest.mark.parametrize("option", ["--conformance-report", "--conformance-shared-dir"])
@pytest.mark.parametrize(("existing", "absolute", "outside"), CASES)
def test_a_path_option_joined_to_its_value_never_moves_the_goldens(
    project, option, existing, absolute, outside
):
    directory = _directory(project, existing, absolute, outside)
    result = project.runpytest("--conformance-family", "gpt3", f"{option}={directory}")
    result.assert_outcomes(passed=2)
    assert _json_files(project.path / "goldens") == [p.removeprefix("goldens/") for p in EXPECTED]


@pytest.mark.parametrize("option", ["--conformance-report", "--conformance-shared-dir"])
@pytest.mark.parametrize(("existing", "absolute", "outside"), CASES)
def test_a_separate_value_pytest_takes_for_a_test_path_is_a_usage_error(
    project, option, existing, absolute, outside
):
    directory = _directory(project, existing, absolute, outside)
    result = project.runpytest("--conformance-family", "gpt3", option, directory)
    if existing and outside:
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(
            [
                "ERROR: pytest took * for a test path and read its configuration from no file "
                "instead of *tox.ini: join path options to their values (--conformance-report=DIR)"
            ]
        )
    else:
        result.assert_outcomes(passed=2)


@pytest.mark.parametrize("update", [False, True], ids=["check", "update"])
@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "relative"])
def test_python_m_conformance_takes_an_existing_report_directory(
    project, monkeypatch, update, absolute
):
    from conformance.cli.run import main

    report = project.path.parent / f"{project.path.name}-report"
    report.mkdir()
    monkeypatch.chdir(project.path)
    where = str(report) if absolute else f"../{report.name}"
    extra = ["--snapshot-update"] if update else []
    args = ["--family", "gpt3", "--report", where, "-k", "shape", *extra]
    assert main([*args, str(project.path / "test_golden.py")]) == 0
    assert _json_files(project.path / "goldens") == [p.removeprefix("goldens/") for p in EXPECTED]
    assert not list(project.path.parent.glob("goldens"))
    assert (report / "report.json").is_file()


@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "relative"])
def test_a_positional_test_path_finds_the_project_from_anywhere(project, monkeypatch, absolute):
    elsewhere = project.path / "sub"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    target = str(project.path / "test_golden.py") if absolute else "../test_golden.py"
    project.runpytest("--conformance-family", "gpt3", target).assert_outcomes(passed=2)


def test_an_override_moves_the_project_goldens_within_it(project):
    result = project.runpytest("--conformance-family", "gpt3", "-o", "conformance_goldens=other")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*missing golden {project.path / 'other'}/gpt3/shape/loop.json*"])
    update = (
        "--conformance-family",
        "gpt3",
        "-o",
        "conformance_goldens=other",
        "--snapshot-update",
    )
    result = project.runpytest(*update)
    result.stdout.fnmatch_lines(
        [f"--snapshot-update: 2 golden(s) written or unchanged under {project.path / 'other'}"]
    )
    assert _json_files(project.path / "other") == [p.removeprefix("goldens/") for p in EXPECTED]


@pytest.mark.parametrize("value", ["../elsewhere", "/tmp"])
def test_goldens_outside_the_project_are_a_usage_error(project, value):
    result = project.runpytest("--conformance-family", "gpt3", "-o", f"conformance_goldens={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: conformance_goldens = {value} resolves to *, outside the project (*)*"]
    )


def test_a_worker_that_resolves_goldens_elsewhere_stops_before_any_test(project):
    project.makeconftest(
        "import pytest\n\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_configure(config):\n"
        "    config.workerinput = {'conformance-goldens': ['gpt3: /elsewhere']}\n"
    )
    result = project.runpytest("--conformance-family", "gpt3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: this xdist worker resolves goldens to *, its controller*"])


def test_xdist_workers_agree_with_their_controller(project):
    project.runpytest("--conformance-family", "gpt3", "-n", "2").assert_outcomes(passed=2)


def test_the_suite_reads_a_shipped_family_goldens_from_its_package_without_a_project(
    pytester, monkeypatch
):
    empty = pytester.path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    selected = "test_structure and not graph-vs-tree"  # a mode pair has no golden
    args = ("--pyargs", "conformance.suite", "--conformance-family", "gpt3", "-k", selected)
    result = pytester.runpytest(*args, "--conformance-tier", "smoke")
    result.assert_outcomes(passed=3)
    assert not list(pytester.path.rglob("*.json"))


def test_a_family_without_goldens_of_its_own_needs_a_project(tmp_path):
    family = Gpt3Family()
    assert Goldens(tmp_path).of(family) == GOLDENS
    assert Goldens(tmp_path).of(family, suite=False) == tmp_path
    with pytest.raises(GoldensError, match="found no configuration file"):
        Goldens(None).of(family, suite=False)
    assert project_goldens(tmp_path, "goldens") == tmp_path.resolve() / "goldens"
    with pytest.raises(GoldensError, match="outside the project"):
        project_goldens(tmp_path, "..")
    assert not installed(GOLDENS)


def test_the_emulation_keeps_its_logs_directory_from_pytest(tmp_path):
    emulated, rest = emulation_parser().parse_known_args(["--logs", str(tmp_path), "-k", "x"])
    assert emulated.logs == tmp_path
    assert rest == ["-k", "x"]


def test_regenerating_the_goldens_an_installed_package_ships_is_refused(pytester, monkeypatch):
    monkeypatch.setattr("conformance.pytest_plugin.session.installed", lambda path: True)
    args = ("--pyargs", "conformance.suite", "--conformance-family", "gpt3", "--snapshot-update")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --snapshot-update would write into an installed package the goldens it "
            f"ships: gpt3 ({GOLDENS}); regenerate them from a clone of the package's repository"
        ]
    )


def test_a_user_golden_test_without_a_project_is_a_usage_error(pytester, monkeypatch):
    pytester.makepyfile(test_golden=GOLDEN_TEST.replace("VALUE", "1"))
    empty = pytester.path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    result = pytester.runpytest(
        "--conformance-family", "gpt3", str(pytester.path / "test_golden.py")
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *test_golden.py::test_shape*: family 'gpt3' keeps its*"])
