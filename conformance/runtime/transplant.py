"""Moving parameters from one side's paths to the other's, without loss."""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import NamedSharding

from conformance.core.distributed import place
from conformance.core.trees import Flat, LeafSpec


class TransplantError(ValueError):
    """Parameters could not be moved to the other side without loss."""


def transplant(
    source: Flat,
    mapping: Mapping[str, str],
    target: Mapping[str, LeafSpec],
    shardings: Mapping[str, NamedSharding] | None = None,
) -> Flat:
    """Move ``source`` parameters to the target side's paths, placed with ``shardings``.

    Guarantees what ``nnx.update`` does not: every target leaf receives a value, no
    source leaf is dropped, and shapes and dtypes agree; otherwise
    :class:`TransplantError` lists every offending path.
    """
    moved = {mapping.get(path, path): value for path, value in source.items()}
    problems = [
        f"  {p}: not set (no source leaf maps to it)" for p in sorted(set(target) - set(moved))
    ]
    problems += [f"  {p}: extra (no such target leaf)" for p in sorted(set(moved) - set(target))]
    for path in sorted(set(moved) & set(target)):
        got = LeafSpec.of(moved[path])
        if got != target[path]:
            problems.append(f"  {path}: source {got} != target {target[path]}")
    if problems:
        raise TransplantError("transplant would lose parameters:\n" + "\n".join(problems))
    if shardings is None:
        return moved
    return {path: place(value, shardings[path]) for path, value in moved.items()}
