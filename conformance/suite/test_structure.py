"""Structure: same leaves, shapes, dtypes and leaf counts on both sides; a golden per layout.

``test_provenance``: each side runs as many bridged modules as its family declares.
"""


def test_structure(conformance_case):
    conformance_case.run()


def test_provenance(conformance_case):
    conformance_case.run()
