"""The README cannot drift from the option table or the check registry.

The options and the checks are each declared once (``pytest_plugin/options.py``,
``checks/registry.py``); the README describes them by hand, so these tests tie the two.
"""

import re
from pathlib import Path

from conformance.checks.registry import CHECKS
from conformance.pytest_plugin.options import OPTIONS

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_the_readme_names_every_option_and_no_other():
    named = set(re.findall(r"--conformance-([a-z][a-z-]*)", README))
    known = {option.name for option in OPTIONS}
    assert named <= known, f"the README names options that do not exist: {sorted(named - known)}"
    missing = [o.flag for o in OPTIONS if o.flag not in README and f"{o.short} " not in README]
    assert not missing, f"options the README does not describe: {missing}"


def test_every_registered_check_has_a_row_in_the_readme():
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", README, re.MULTILINE))
    missing = sorted(set(CHECKS) - rows)
    assert not missing, f"checks without a README row: {missing}"
