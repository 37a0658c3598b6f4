"""Structure: same leaves, shapes, dtypes and leaf counts on both sides; a golden per layout."""


def test_structure(conformance_case):
    conformance_case.run()
