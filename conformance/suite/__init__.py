"""The conformance suite: one test per check of :mod:`conformance.checks.registry`.

Each module holds the tests of the checks the registry files under it
(:attr:`~conformance.checks.registry.Check.suite_module`), made by
:func:`~conformance.suite.generated.check_tests`: no check is written twice, and a
registered check cannot go uncollected. Each test is parametrized by the pytest plugin
from the check's registry entry and runs it on its case. Run it on any installed family
with ``pytest --pyargs conformance.suite``.
"""
