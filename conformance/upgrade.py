"""``python -m conformance.upgrade``: see :mod:`conformance.cli.upgrade`."""

import sys

from conformance.cli.upgrade import main

if __name__ == "__main__":
    sys.exit(main())
