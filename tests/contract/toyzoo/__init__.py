"""A third-party model zoo, written only from the harness's public docs.

Installed into a throwaway distribution by ``tests/contract/test_third_party.py`` and
registered through the ``conformance.families`` entry point, as a zoo would.
"""
