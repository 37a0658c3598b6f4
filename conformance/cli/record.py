"""Record the references a family declares: what one backend computes, kept as files.

Usage: ``python -m conformance.record [--family NAME ...] [--backend {linen,nnx}]
[--goldens DIR] [--update | --extend]``. Each family (default: every registered family that
declares ``Recorded`` references) is run on one CPU device from each backend it
declares (or only ``--backend``), and its reference is written to
``<goldens>/references/<family>/<backend>/``, where ``<goldens>`` is the directory
the family ships its own in (:attr:`~conformance.contract.Family.goldens`), else
``--goldens``.

A reference is reviewed like a golden, so this never changes one silently: a new
reference is written, an identical one is left as it is, and one that would change is
refused unless ``--update`` is given (then explain the change in the commit). With
``--extend`` a reference recorded by an earlier harness, which records less, gains only
what it lacks (bfloat16 train steps, say), computed from its own parameters and batch:
every recorded number is kept, and the manifest says what was added with which versions.
Only the references asked for are touched; nothing is ever deleted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
        prog="python -m conformance.record",
        description="Record a family's reference from one backend, for the recorded_* checks.",
    )
    cli.add_argument(
        "--family",
        action="append",
        default=[],
        help="family to record (repeatable); default: every family declaring Recorded",
    )
    cli.add_argument(
        "--backend",
        choices=("linen", "nnx"),
        help="record only this backend; default: each the family declares",
    )
    add_goldens(cli)
    change = cli.add_mutually_exclusive_group()
    change.add_argument(
        "--update", action="store_true", help="replace references whose numbers changed"
    )
    change.add_argument(
        "--extend",
        action="store_true",
        help="add only what a reference lacks, keeping every recorded number",
    )
    cli.add_argument("--xla-opt", choices=XLA_OPT_LEVELS, default="low")
    return cli


def main(argv: Sequence[str] | None = None) -> int:
    """Record what was asked; 0 when every reference was written or unchanged, else 1."""
    args = parser().parse_args(argv)
    configure_host_platform()
    set_xla_opt(args.xla_opt)
    set_matmul_precision()
    from conformance import contract
    from conformance.core.references import (
        ARRAYS,
        ReferenceError,
        directory,
        encode,
        extend,
        read,
        references_root,
        write,
    )
    from conformance.core.roots import Goldens, installed
    from conformance.runtime.recording import record

    try:
        families = (
            [contract.get(name) for name in args.family]
            if args.family
            else [f for f in contract.registry().values() if contract.recorded_backends(f)]
        )
    except contract.FamilyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    refused = 0
    for family in families:
        declared = contract.recorded_backends(family)
        backends = declared if args.backend is None else (args.backend,)
        if not set(backends) <= set(declared):
            print(
                f"error: {family.name} declares recorded references of {list(declared)}, "
                f"not {args.backend}: a reference it does not declare would be unused",
                file=sys.stderr,
            )
            return 2
        if (reason := family.unavailable()) is not None:
            print(f"error: {family.name}: {reason}", file=sys.stderr)
            return 2
        root = Goldens(args.goldens.resolve()).of(family)
        if installed(root):
            print(
                f"error: {family.name} ships its references in an installed package ({root}): "
                "record them from a clone of the package's repository",
                file=sys.stderr,
            )
            return 2
        for backend in backends:
            where = directory(references_root(root), family.name, backend)
            reference = record(family, backend)
            if args.extend and (where / ARRAYS).is_file():
                try:
                    reference = extend(read(where), reference)
                except ReferenceError as err:
                    refused += 1
                    print(f"{where}: not extended: {err}")
                    continue
            files = encode(reference)
            old = {n: (where / n).read_bytes() for n in files if (where / n).is_file()}
            if old == files:
                print(f"{where}: unchanged")
            elif old and not (args.update or args.extend):
                refused += 1
                what = "numbers" if old.get(ARRAYS) != files[ARRAYS] else "manifest"
                print(
                    f"{where}: the recorded {what} changed; not written (rerun with "
                    "--update to replace it, and explain the change in the commit)"
                )
            else:
                write(where, reference)
                done = "extended" if args.extend and old else "updated" if old else "new"
                print(f"{where}: {done}")
    return 1 if refused else 0
