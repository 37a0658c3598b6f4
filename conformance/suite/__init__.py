"""The conformance suite: one test per check of :mod:`conformance.checks.registry`.

Each test is parametrized by the pytest plugin from the check's registry entry and runs
it on its case. Run it on any installed family with ``pytest --pyargs conformance.suite``.
"""
