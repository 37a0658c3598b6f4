"""Show what changed between a family's releases: its goldens, checkpoints and numbers.

Usage: ``python -m conformance.upgrade [--family PATTERN ...] [--goldens DIR] [--report
DIR]``. For each selected family that keeps its goldens per release
(a ``Release`` feature; MaxText's families) and can run here:

* **goldens**: every golden of each earlier release's folder against the installed
  release's, leaf by leaf (structure, sharding, cost, ...);
* **checkpoints**: the one-step train state each recorded reference holds (a checkpoint
  written by the release that recorded it) against the live train state of the same
  backend: leaves unchanged, and each leaf that moved (another kind, shape or dtype),
  disappeared or is new. Whether it restores after the family's version map is what
  ``recorded_resume`` checks;
* **numbers**: the ``recorded_*`` checks' verdicts (the installed release from the
  recorded parameters and batch, against the recorded numbers), read from the report of
  a run in ``--report DIR``.

Printed as Markdown; with ``--report DIR`` also added to that report's files as the
"Release upgrade" section (``make upgrade-report`` runs the checks and this).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.cli.options import add_goldens
from conformance.core.environment import (
    XLA_OPT_LEVELS,
    configure_host_platform,
    set_matmul_precision,
    set_xla_opt,
)


def parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    cli = argparse.ArgumentParser(
        prog="python -m conformance.upgrade",
        description="What changed since a family's earlier releases: goldens, checkpoints, "
        "numbers.",
    )
    cli.add_argument(
        "--family",
        action="append",
        default=[],
        help="family name or glob (repeatable); default: every family keeping goldens per release",
    )
    add_goldens(cli)
    cli.add_argument(
        "--report", type=Path, help="a run's report directory: read its verdicts, add the section"
    )
    cli.add_argument("--xla-opt", choices=XLA_OPT_LEVELS, default="low")
    return cli


def _golden_files(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*.json")} if folder.is_dir() else set()


_COST_MEASURES = ("flops", "bytes_accessed", "temp_bytes", "footprint_bytes")
"""The compiled-cost measures summarised as ratios between releases (a TPU compile's
footprint per chip among them)."""

_COSTED = ("cost", "tpu_compile")
"""The checks whose goldens hold compiled costs per program and side."""


def cost_ratios(old: Any, new: Any) -> list[str]:
    """``forward nnx: flops 2.129x, bytes_accessed 1.562x`` per program and side that moved.

    ``old`` and ``new`` are cost or TPU-compile goldens
    (``programs/<program>/<side>/<measure>``); a measure within 0.1 % of the earlier
    release's, or missing from either, is left out.
    """
    found = []
    for program, sides in sorted(new.get("programs", {}).items()):
        for side, now in sorted(sides.items()):
            was = old.get("programs", {}).get(program, {}).get(side)
            if was is None:
                continue
            moved = [
                f"{m} {now[m] / was[m]:.3f}x"
                for m in _COST_MEASURES
                if was.get(m) and now.get(m) is not None and abs(now[m] / was[m] - 1) > 1e-3
            ]
            if moved:
                found.append(f"{program} {side}: {', '.join(moved)}")
    return found


def golden_changes(root: Path, family: str, release: str) -> tuple[list[dict[str, Any]], int]:
    """Each golden that changed, appeared or went from an earlier release to ``release``.

    Returns the changes and how many goldens are unchanged. Earlier releases are the
    other folders under ``root/family``.
    """
    from conformance.core.goldens import changes, load

    base = root / family
    now = _golden_files(base / release)
    found, same = [], 0
    for old in sorted(p.name for p in base.iterdir() if p.is_dir() and p.name != release):
        was = _golden_files(base / old)
        for name in sorted(was | now, key=str):
            entry = {"from": old, "golden": str(name), "lines": []}
            if name not in now or name not in was:
                found.append(entry | {"change": "removed" if name not in now else "added"})
                continue
            before, after = load(base / old / name), load(base / release / name)
            if not (lines := changes(before, after)):
                same += 1
                continue
            if name.parts[0] in _COSTED:  # the ratios first, then the numbers
                lines = cost_ratios(before, after) + lines
            found.append(entry | {"change": "changed", "lines": lines})
    return found, same


def _spec(kind: str, dtype: str, shape: Sequence[int]) -> str:
    return f"{kind} {dtype}[{', '.join(str(n) for n in shape)}]"


def checkpoint_changes(family: Any, backend: str, references: Path) -> dict[str, Any]:
    """The recorded one-step state of ``backend`` against the live train state's layout.

    Paths are canonical on both sides; nothing is mapped, so a leaf the version map
    moves shows as moved.
    """
    from conformance.core.trees import specs
    from conformance.runtime.recorded import load
    from conformance.runtime.recording import reference_case
    from conformance.runtime.sides import SIDES
    from conformance.runtime.train_state import flat_state

    reference = load(family, backend, references)
    side = SIDES[backend](reference_case(family))
    trainer = side.trainer()
    live = side.canonical(specs(flat_state(trainer.abstract_state)))
    live_kinds = side.canonical(trainer.kinds)
    recorded = reference.state_as_recorded()
    recorded_kinds = reference.state_kinds()
    moved, same = [], 0
    for path in sorted(recorded.keys() | live.keys()):
        if path in recorded:
            array = recorded[path]
            was = _spec(recorded_kinds.get(path, "?"), array.dtype.name, array.shape)
        if path in live:
            now = _spec(live_kinds.get(path, "?"), live[path].dtype, live[path].shape)
        if path not in live:
            moved.append(f"{path}: recorded {was}; not in the live state")
        elif path not in recorded:
            moved.append(f"{path}: new in the live state, {now}")
        elif was != now:
            moved.append(f"{path}: recorded {was}, live {now}")
        else:
            same += 1
    return {
        "backend": backend,
        "recorded_with": reference.label,
        "leaves": len(recorded),
        "unchanged": same,
        "moved": moved,
    }


def upgrade_of(family: Any, goldens: Path) -> dict[str, Any]:
    """The release-upgrade section of ``family`` (see the module)."""
    from conformance.contract import recorded_backends, release
    from conformance.core.references import references_root

    changed, same = golden_changes(goldens, family.name, release(family))
    root = references_root(goldens)
    return {
        "family": family.name,
        "release": release(family),
        "goldens": changed,
        "unchanged_goldens": same,
        "checkpoints": [
            checkpoint_changes(family, backend, root) for backend in recorded_backends(family)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print the section of each selected family (and add it to ``--report``); 0 when done."""
    args = parser().parse_args(argv)
    configure_host_platform()
    set_xla_opt(args.xla_opt)
    set_matmul_precision()
    from conformance import contract
    from conformance.core.roots import Goldens
    from conformance.report import model, render
    from conformance.runtime.recorded import MissingReference

    started = time.time()
    try:
        selected = contract.select(args.family)
    except contract.FamilyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.family and (
        cannot := [f"{f.name}: {why}" for f in selected if (why := f.unavailable())]
    ):
        print(f"error: named families cannot run here: {'; '.join(cannot)}", file=sys.stderr)
        return 2
    families = [f for f in selected if f.unavailable() is None and contract.release(f)]
    if not families:
        print(
            "error: no selected family keeps its goldens per release (a Release feature) here",
            file=sys.stderr,
        )
        return 2
    try:
        goldens = Goldens(args.goldens.resolve())
        upgrades = [upgrade_of(family, goldens.of(family)) for family in families]
    except (MissingReference, contract.FamilyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"upgrades": upgrades, "tests": []}
    if args.report is not None:
        run = model.header("upgrade", [], args.xla_opt, [f.name for f in families])
        run |= {
            "command": ["python", "-m", "conformance.upgrade", *(argv or sys.argv[1:])],
            "started": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(),
            "duration_s": round(time.time() - started, 3),
            "exit_status": 0,
        }
        report = render.add_part(args.report, run, [], upgrades)
        print(f"report: {args.report / 'report.md'} (section 'Release upgrade')")
    print("\n".join(["# Release upgrade", *model.upgrade_lines(report)]))
    return 0
