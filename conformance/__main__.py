"""``python -m conformance``: the parity run of every registered family on the CPU mesh.

Runs the conformance suite in one process at the ``default`` tier, with one progress
line per family x check, and prints the family x check agreement matrix. Other arguments
go to pytest; the plugin's options may be given without their ``--conformance-`` prefix
(``--family llama``, ``--tier smoke``, ``--mesh fsdp=8``). Exits non-zero when any check
disagrees (and with 5 when nothing was selected).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest

SHORT_OPTIONS = (
    "--family",
    "--mesh",
    "--topology",
    "--tier",
    "--xla-opt",
    "--progress",
    "--report",
)
"""Plugin options this command takes without their ``--conformance-`` prefix."""


def expand(argv: Sequence[str]) -> list[str]:
    """``argv`` with each short plugin option (``--tier smoke``, ``--tier=smoke``) prefixed."""
    expanded = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in SHORT_OPTIONS:
            arg = f"--conformance-{name[2:]}{eq}{value}"
        expanded.append(arg)
    return expanded


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite with ``argv`` as extra pytest arguments; return pytest's exit code."""
    # `python -m conformance` has imported this package before pytest could rewrite it.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args = ["--pyargs", "conformance.suite", "-q", "-p", "no:cacheprovider", *quiet]
    args.append("--conformance-progress")
    return int(pytest.main([*args, *expand(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
