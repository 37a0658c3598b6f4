"""Options more than one command-line tool takes, each declared once."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_goldens(cli: argparse.ArgumentParser) -> None:
    """``--goldens DIR``: the project's goldens, for a family that does not ship its own."""
    cli.add_argument(
        "--goldens",
        type=Path,
        default=Path("goldens"),
        help="the project's goldens directory, for a family that does not ship its own "
        "(Family.goldens; the built-in families do); default: ./goldens",
    )
