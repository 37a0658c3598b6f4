"""Convert a checkpoint between the Linen and NNX layouts (and layer layouts).

Usage: ``python -m conformance.convert SRC DST [--to {auto,linen,nnx}] [--layout
{same,loop,scan}]``. SRC is a checkpoint directory written by
:func:`conformance.runtime.checkpoints.save`; its ``conformance.json`` names the family, size,
backend and layout. SRC is only read: DST must not exist, must not be inside SRC, and is
written to a temporary sibling first and renamed into place. Before converting, SRC is
restored strictly against the train state its family and size define, so a checkpoint
of another family or size, or a damaged one, is refused with the paths that differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance import contract
from conformance.contract import Backend
from conformance.runtime.checkpoints import (
    CheckpointError,
    convert,
    expected_layout,
    read_info,
    restore,
    save,
)


def parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    cli = argparse.ArgumentParser(
        prog="python -m conformance.convert",
        description="Convert a conformance train-state checkpoint between Linen and NNX.",
    )
    cli.add_argument("source", type=Path, help="checkpoint directory to read (never written)")
    cli.add_argument("destination", type=Path, help="new checkpoint directory to create")
    cli.add_argument(
        "--to",
        choices=("auto", "linen", "nnx"),
        default="auto",
        help="target backend; auto: the other one (default)",
    )
    cli.add_argument(
        "--layout",
        choices=("same", "loop", "scan"),
        default="same",
        help="target layer layout: a list of layers (loop) or stacked layers (scan); "
        "default: the source's",
    )
    return cli


def run(source: Path, destination: Path, to: str = "auto", layout: str = "same") -> str:
    """Convert ``source`` into the new ``destination``; return a one-line summary.

    Raises :class:`~conformance.runtime.checkpoints.CheckpointError` or
    :class:`~conformance.contract.FamilyError` with the reason; nothing is written then.
    """
    source, destination = source.resolve(), destination.resolve()
    if destination.exists():
        raise CheckpointError(f"{destination} already exists; refusing to write over it")
    if destination.is_relative_to(source):
        raise CheckpointError(f"{destination} is inside the source {source}; choose another place")
    info = read_info(source)
    family = contract.get(info.family)
    config = family.config(info.size, scan_layers=info.scan_layers)
    try:
        state = restore(source, expected_layout(family, config, info.backend))
    except CheckpointError as err:
        raise CheckpointError(
            f"{source} is not a {info.backend} {info.family}/{info.size}/{info.layout} "
            f"train state as its {source.name}/conformance.json says:\n{err}"
        ) from None
    backend = info.backend.other if to == "auto" else Backend(to)
    scan = info.scan_layers if layout == "same" else layout == "scan"
    converted, new_info = convert(state, family, info, backend, scan)
    save(destination, converted, new_info)
    return (
        f"converted {info.family}/{info.size} {info.backend}/{info.layout} -> "
        f"{new_info.backend}/{new_info.layout}: {len(converted)} leaves written to {destination}"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 on success, 2 with a one-line reason on bad input."""
    args = parser().parse_args(argv)
    try:
        print(run(args.source, args.destination, args.to, args.layout))
    except (CheckpointError, contract.FamilyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
