"""``python -m conformance``: the parity run of every registered family on the CPU mesh.

Runs the conformance suite in one process at the ``default`` tier, with one progress
line per family x check, and prints the family x check agreement matrix; extra
arguments go to pytest (e.g. ``--family llama``, ``--tier smoke`` or ``--mesh fsdp=8``).
Exits non-zero when any check disagrees (and with 5 when nothing was selected).
"""

from __future__ import annotations

import sys

import pytest


def main(argv: list[str] | None = None) -> int:
    """Run the suite with ``argv`` as extra pytest arguments; return pytest's exit code."""
    # `python -m conformance` has imported this package before pytest could rewrite it.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args = ["--pyargs", "conformance.suite", "-q", "--progress", "-p", "no:cacheprovider", *quiet]
    return int(pytest.main([*args, *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
