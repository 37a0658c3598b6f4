"""The conformance suite: thin pytest wrappers over :mod:`conformance.checks`.

Run it on any installed family with ``pytest --pyargs conformance.suite``.
"""
