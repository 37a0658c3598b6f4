"""The suite's test functions, made from the check registry: one per registered check."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from conformance.checks.registry import checks


def _test(name: str, module: str) -> Callable[[Any], None]:
    def test(conformance_case: Any) -> None:
        conformance_case.run()

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__module__ = module
    test.__doc__ = f"The ``{name}`` check on the case the plugin parametrizes."
    # Located in its suite module, not here: failures and reports name the module.
    test.__code__ = test.__code__.replace(co_filename=sys.modules[module].__file__)
    return test


def check_tests(module: str) -> dict[str, Callable[[Any], None]]:
    """The test functions of suite module ``module``: one per check filed under it.

    In the registry's order, named ``test_<check>``; each runs its check on the case
    the ``conformance_case`` fixture gives it. ``module`` must be being imported (its
    file names each test's location).
    """
    short = module.rsplit(".", 1)[-1]
    return {
        f"test_{name}": _test(name, module)
        for name, check in checks().items()
        if check.suite_module == short
    }
