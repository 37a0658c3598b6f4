"""Structure: same leaves, shapes, dtypes and leaf counts on both sides; a golden per layout.

``test_provenance``: each side runs as many bridged modules as its family declares.
"""

from conformance.suite.generated import check_tests

globals().update(check_tests(__name__))
