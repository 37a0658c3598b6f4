"""The docs cannot drift from the code, and the README stays a front page.

The checks and options tables are generated from the check registry and the option table
when the docs are built (``docs/_ext/conformance_tables.py``, ``make docs``); these tests
hold the hand-written pages to the same names, and the README to its links.
"""

import importlib.util
import inspect
import re
from pathlib import Path

from conformance.checks.registry import BUILTIN
from conformance.contract.declared import FIRST_EDITION
from conformance.pytest_plugin.options import OPTIONS

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PAGES = {page.name: page.read_text() for page in DOCS.glob("*.md")}
MAX_README_LINES = 250


def _tables():
    spec = importlib.util.spec_from_file_location("tables", DOCS / "_ext/conformance_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_front_page_whose_links_resolve():
    assert len(README.splitlines()) <= MAX_README_LINES
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links, "the README links to no page of the docs"
    broken = [link for link in links if not (ROOT / link).is_file()]
    assert not broken, f"README links to files that do not exist: {broken}"


def test_every_page_is_in_the_index():
    index = PAGES["index.md"]
    missing = [name for name in PAGES if name != "index.md" and f"\n{name[:-3]}\n" not in index]
    assert not missing, f"pages no toctree of docs/index.md lists: {missing}"


def test_the_generated_tables_hold_every_check_and_option():
    tables = _tables()
    checks, options = tables.checks_table(), tables.options_table()
    assert not [name for name in BUILTIN if f"| `{name}` |" not in checks]
    assert not [o.flag for o in OPTIONS if f"| `{o.flag}` |" not in options]


def test_the_features_table_holds_every_feature_with_its_first_edition():
    tables = _tables()
    table, kinds = tables.features_table(), tables.FEATURES
    assert len(kinds) >= len(FIRST_EDITION) + 1
    assert not [kind.__name__ for kind in kinds if f"| `{kind.__name__}(" not in table]
    second = {kind: inspect.getdoc(kind).split("\n\n")[1:2] for kind in kinds}
    opening = {
        kind: "The first edition's" if kind in FIRST_EDITION else "New in the second edition"
        for kind in kinds
    }
    assert not [k.__name__ for k in kinds if not "".join(second[k]).startswith(opening[k])]


def test_the_pages_name_only_options_that_exist():
    text = README + "".join(PAGES.values())
    named = set(re.findall(r"--conformance-([a-z][a-z-]*[a-z])", text))
    known = {option.name for option in OPTIONS}
    assert named <= known, f"the docs name options that do not exist: {sorted(named - known)}"


def test_every_registered_check_is_described_in_full_and_no_other():
    text = PAGES["checks.md"] + PAGES["tpu.md"]
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, re.MULTILINE))
    assert not sorted(set(BUILTIN) - rows), "checks the docs do not describe in full"
    assert not sorted(rows - set(BUILTIN)), "the docs describe checks that do not exist"
