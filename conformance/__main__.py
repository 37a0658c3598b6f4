"""``python -m conformance``: see :mod:`conformance.cli.run`."""

import sys

from conformance.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
