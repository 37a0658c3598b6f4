"""``python -m conformance.record``: see :mod:`conformance.cli.record`."""

import sys

from conformance.cli.record import main

if __name__ == "__main__":
    sys.exit(main())
