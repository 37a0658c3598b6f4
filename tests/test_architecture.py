"""The package's layers and their one-way imports, and a plugin that stays inert.

Layers, each importing only those before it:

    contract -> core -> runtime -> checks -> pytest_plugin, cli

``report`` builds on ``core`` only. Within ``checks``, an area module imports the kernel
and no other check module; the registry lists them all. No module imports, at any
depth of its code, one that imports it back (inside a package too). Only the pytest plugin, the
report collector and the command line import pytest. Nothing in the harness imports a
concrete family (``conformance_models``) or the test suite, and the built-in families
reach the harness only through its public face, ``conformance.families``.
"""

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "conformance"
MODELS = ROOT / "models"

ALLOWED = {
    "contract": set(),
    "core": {"contract"},
    "runtime": {"contract", "core"},
    "checks": {"contract", "core", "runtime"},
    "report": {"core"},
    "pytest_plugin": {"contract", "core", "runtime", "checks", "report"},
    "cli": {"contract", "core", "runtime", "report", "pytest_plugin"},
    "suite": {"checks"},
    "families": {"contract"},
    "__init__": set(),
    "__main__": {"cli"},
    "convert": {"cli"},
    "record": {"cli"},
    "upgrade": {"cli"},
}
"""What each top-level part of ``conformance`` may import of the others (and itself)."""

PYTEST_USERS = ("conformance.pytest_plugin", "conformance.report.collector", "conformance.cli.run")
HEAVY = ("jax", "jaxlib", "flax", "qwix", "aqt", "orbax", "optax", "syrupy")


def _module(path: Path, root: Path, package: str) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join((package, *parts))
    return name.removesuffix(".__init__")


def imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at any depth of its code, as absolute names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return found


def harness_modules() -> dict[str, set[str]]:
    return {
        (name := _module(path, PACKAGE, "conformance")): imports(path, name)
        for path in PACKAGE.rglob("*.py")
    }


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    """Whether ``name`` is a harness module (not a name imported from one)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_each_layer_imports_only_the_layers_before_it():
    wrong = []
    for module, found in harness_modules().items():
        part = _part(module)
        for name in sorted(found):
            if not name.startswith("conformance.") or not _is_module(name):
                continue
            other = _part(name)
            if other != part and other not in ALLOWED[part]:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def module_edges(path: Path, module: str) -> set[str]:
    """The harness modules ``path`` imports, at any depth: ``from package import sub``
    is an edge to ``package.sub``, not to the package."""
    found = set()
    for name in imports(path, module):
        if name.startswith("conformance") and _is_module(name):
            found.add(name)
    for node in ast.walk(ast.parse(path.read_text())):
        submodules = isinstance(node, ast.ImportFrom) and node.module and not node.level
        if submodules and all(_is_module(f"{node.module}.{a.name}") for a in node.names):
            found.discard(node.module)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node] & graph.keys()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere_not_even_inside_a_package():
    graph = {
        (name := _module(path, PACKAGE, "conformance")): module_edges(path, name)
        for path in PACKAGE.rglob("*.py")
    }
    assert _circles(graph) == []


def test_the_circle_finder_sees_a_circle_through_function_local_imports():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


KERNEL = "conformance.checks.kernel"
REGISTRY = "conformance.checks.registry"
SHARED = ("conformance.checks.declare", "conformance.checks.raised")
"""Modules of ``checks`` that hold no check: how a check declares itself and reports."""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_check_module_imports_another_only_the_kernel():
    """An area module imports the kernel's face and the shared modules only.

    The kernel and the shared modules import no area module. The registry, which lists
    every area's checks, imports them all; its own modules import each other.
    """
    wrong = []
    for module, found in harness_modules().items():
        if not module.startswith("conformance.checks.") or _within(module, REGISTRY):
            continue
        in_kernel = _within(module, KERNEL)
        for name in sorted(n for n in found if n.startswith("conformance.checks")):
            if name in ("conformance.checks", KERNEL, *SHARED) or not _is_module(name):
                continue
            if not (in_kernel and name.startswith(KERNEL + ".")):
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_only_the_plugin_the_report_collector_and_the_cli_import_pytest():
    wrong = [
        module
        for module, found in harness_modules().items()
        if "pytest" in found
        and not module.startswith(PYTEST_USERS)
        and not module.startswith("conformance.suite")
    ]
    assert not wrong, wrong


def test_the_harness_imports_no_family_and_families_only_the_public_face():
    wrong = [
        f"{module} imports {name}"
        for module, found in harness_modules().items()
        for name in found
        if name.startswith(("conformance_models", "models", "tests"))
    ]
    for path in MODELS.rglob("*.py"):
        module = _module(path, MODELS, "conformance_models")
        wrong += [
            f"{module} imports {name}"
            for name in imports(path, module)
            if name.startswith("conformance.") and not name.startswith("conformance.families")
        ]
    assert not wrong, "\n".join(wrong)


PROBE = """
import sys

import pytest

code = pytest.main(["-q", "-p", "no:syrupy", "-p", "no:cacheprovider", "test_plain.py"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print("loaded:", "conformance.pytest_plugin" in sys.modules, "heavy:", heavy, "code:", int(code))
"""


def test_a_plain_pytest_run_loads_the_plugin_and_imports_nothing_heavy(tmp_path):
    """The entry point is loaded in any pytest run; it must not import jax and friends."""
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    probe = textwrap.dedent(PROBE).replace("set(HEAVY)", repr(set(HEAVY)))
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert "loaded: True heavy: [] code: 0" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_every_part_named_in_the_rules_exists(part):
    assert (PACKAGE / part).is_dir() or (PACKAGE / f"{part}.py").exists()


def test_every_package_ships_in_the_wheel():
    """pyproject lists its packages by hand: a new subpackage left out of it is missing from
    the wheel, and only the installed run would notice."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        root = ROOT / folder
        found |= {
            ".".join((name, *init.parent.relative_to(root).parts))
            for init in root.rglob("__init__.py")
            if "goldens" not in init.parts
        }
    assert sorted(found - listed) == []


MAX_MODULE_LINES = 450
"""A module longer than this holds more than one job: split it by what it does."""


def test_no_harness_module_exceeds_its_length():
    long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
