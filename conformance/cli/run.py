"""``python -m conformance``: the parity run of every registered family on the CPU mesh.

Runs the conformance suite in one process at the ``default`` tier, with one progress
line per family x check, and prints the family x check agreement matrix. Other arguments
go to pytest; the plugin's options may be given without their ``--conformance-`` prefix
(``--family llama``, ``--tier smoke``, ``--mesh fsdp=8``). Exits non-zero when any check
disagrees (and with 5 when nothing was selected).

``--processes N --devices-per-process M`` emulates a multi-host run on this machine:
N processes of M CPU devices each run the same suite in step (:mod:`conformance.cli.launch`),
with ``--timeout SECONDS`` (default 3600) and ``--logs DIR`` (default: a new temporary
directory) for their logs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from conformance.cli import launch
from conformance.pytest_plugin.options import expand


def emulation_parser() -> argparse.ArgumentParser:
    """The options of an emulated multi-host run; everything else goes to every process."""
    parser = argparse.ArgumentParser(prog="python -m conformance", add_help=False)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run the suite as N local processes joined by jax.distributed (default: 1)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=4,
        metavar="M",
        help="CPU devices each emulated process has (default: 4)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="stop every emulated process after this long, exit 124 (default: 3600)",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="where each emulated process writes process-<i>.log and the shared "
        "checkpoint directory (default: a new temporary directory, printed first)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite with ``argv`` as extra pytest arguments; return pytest's exit code.

    With ``--processes N`` (N > 1), run it as N local processes instead and return the
    first failing process's exit status (0 if all pass).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    emulated, rest = emulation_parser().parse_known_args(argv)
    if emulated.processes < 1 or emulated.devices_per_process < 1:
        print("error: --processes and --devices-per-process must be at least 1", file=sys.stderr)
        return int(pytest.ExitCode.USAGE_ERROR)
    if emulated.processes > 1:
        emulation = launch.Emulation(
            emulated.processes,
            emulated.devices_per_process,
            emulated.timeout,
            (emulated.logs or launch.default_logs()).resolve(),
        )
        return launch.run(emulation, rest)
    # `python -m conformance` has imported this package before pytest could rewrite it.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args = ["--pyargs", "conformance.suite", "-q", "-p", "no:cacheprovider", *quiet]
    args.append("--conformance-progress")
    return int(pytest.main([*args, *expand(argv), *whole_groups(argv)]))


def whole_groups(argv: Sequence[str]) -> list[str]:
    """``--dist loadgroup`` when pytest-xdist workers are asked for and no ``--dist`` is.

    A group's tests share their compiled programs; on one worker each compiles once.
    """
    workers = any(a.startswith(("-n", "--numprocesses")) for a in argv)
    if workers and not any(a.startswith(("--dist", "-d")) for a in argv):
        return ["--dist", "loadgroup"]
    return []
