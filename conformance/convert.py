"""``python -m conformance.convert``: see :mod:`conformance.cli.convert`."""

import sys

from conformance.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
