"""The pytest plugin of the conformance harness: the ``pytest11`` entry point's hooks.

Any project with this package installed can run the suite on its own families
(``pytest --pyargs conformance.suite``). In every other pytest run the plugin stays
inert: it declares its options (:mod:`~conformance.pytest_plugin.options`) and markers,
and imports nothing heavier than pytest. In a conformance run,
:func:`~conformance.pytest_plugin.session.configure` sets the run up and
:func:`~conformance.pytest_plugin.parts.register` registers the working parts:
parametrization and fixtures (:mod:`~conformance.pytest_plugin.suite`), goldens, the
matrix, scopes per group of tests, progress and reports.
"""

from __future__ import annotations

import pytest

from conformance.pytest_plugin import options
from conformance.pytest_plugin.tiers import TierError, get_tier

MARKERS = (
    "golden: the test compares against a golden file",
    "capability(name): run only on families whose Capabilities declare it (else skip)",
    "layouts(*scan_layers): run only on families supporting each of these layer layouts "
    "(True: scanned), else skip",
    "quant_method(name): parametrize `quant` only over modes of this method",
    "variant: the test compares a quantized, lower-precision, accumulated or tiled variant "
    "of the train step or forward (the default tier runs it on its primary mesh, in the "
    "family's preferred layer layout)",
)
"""Markers a user's own test over the plugin's axes may carry (the suite's checks say
the same in the check registry)."""


LIBRARY_NOISE = ("ignore::DeprecationWarning:qwix",)
"""Warnings filters of a conformance run, wherever it runs (an installed package has no
ini of this project): qwix 0.1.8 calls flax APIs that flax 0.12.12 deprecates, thousands
of times per run."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Declare the ``--conformance-*`` options and the ``conformance_*`` ini options."""
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Validate the tier and, in a conformance run only, set the run up.

    A bad option is a usage error listing the valid values; a pytest run that does not
    select the suite (:func:`~conformance.pytest_plugin.options.selects_suite`) is left
    alone.
    """
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    try:
        tier = get_tier(options.value(config, "tier"))
    except TierError as err:
        raise pytest.UsageError(str(err)) from None
    if not options.selects_suite(config):
        return
    for noise in LIBRARY_NOISE:
        config.addinivalue_line("filterwarnings", noise)
    from conformance.pytest_plugin import parts, session

    parts.register(config, session.configure(config, tier))
