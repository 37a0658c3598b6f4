"""Structure: same leaves, shapes, dtypes and leaf counts on both sides; a golden per layout."""

import pytest

from conformance.checks import check_structure


@pytest.mark.golden
def test_structure(family, size, scan_layers, golden):
    config = family.config(size, scan_layers=scan_layers)
    golden.check(check_structure(family, config))
