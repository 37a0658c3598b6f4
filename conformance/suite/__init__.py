"""The conformance suite: one test per check of :mod:`conformance.checks.registry`.

Each module holds the tests of the checks the registry files under it
(:attr:`~conformance.checks.registry.Check.suite_module`), made by :func:`check_tests`: no
check is written twice, and a registered check cannot go uncollected. Each test is
parametrized by the pytest plugin from the check's registry entry and runs it on its
case. Run it on any installed family with ``pytest --pyargs conformance.suite``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.checks.registry import CHECKS


def _test(name: str, module: str) -> Callable[[Any], None]:
    def test(conformance_case: Any) -> None:
        conformance_case.run()

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__module__ = module
    test.__doc__ = f"The ``{name}`` check on the case the plugin parametrizes."
    return test


def check_tests(module: str) -> dict[str, Callable[[Any], None]]:
    """The test functions of suite module ``module``: one per check filed under it.

    In the registry's order, named ``test_<check>``; each runs its check on the case
    the ``conformance_case`` fixture gives it.
    """
    short = module.rsplit(".", 1)[-1]
    return {
        f"test_{name}": _test(name, module)
        for name, check in CHECKS.items()
        if check.suite_module == short
    }
