"""What a compiled program costs: XLA's cost and memory analyses, and its collectives.

:func:`cost_of` reads a compiled program (``jax.jit(f).lower(...).compile()``): flops and
bytes accessed from XLA's cost analysis, argument, output, temporary and aliased bytes
from its memory analysis, and every collective in the optimised HLO by kind, with its
count and the bytes it produces. Nothing is compiled here.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
"""The HLO collective operations counted (``-start`` forms count as their operation)."""

_OP = re.compile(r"=\s*(?P<shape>[^=]*?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9a-z]*)\[(?P<dims>[0-9,]*)\]")
_BITS = re.compile(r"(\d+)")


def _element_bytes(dtype: str) -> int:
    if dtype == "pred":
        return 1
    found = _BITS.search(dtype)
    return max(1, int(found.group(1)) // 8) if found else 4


def _shape_bytes(shape: str) -> int:
    total = 0
    for array in _ARRAY.finditer(shape):
        count = 1
        for dim in filter(None, array.group("dims").split(",")):
            count *= int(dim)
        total += count * _element_bytes(array.group("dtype"))
    return total


@dataclasses.dataclass(frozen=True)
class Cost:
    """One compiled program's cost, as XLA reports it."""

    flops: float
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    collectives: dict[str, tuple[int, int]]
    """``{kind: (count, bytes produced)}`` for each collective kind the program runs."""

    def table(self) -> dict[str, Any]:
        """The cost as plain JSON values (collectives as ``{kind: {count, bytes}}``)."""
        found = dataclasses.asdict(self)
        found["collectives"] = {
            kind: {"count": count, "bytes": size}
            for kind, (count, size) in sorted(self.collectives.items())
        }
        return found


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes produced)}`` of the collectives in optimised HLO text."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for line in hlo.splitlines():
        found = _OP.search(line)
        if found is None or "-done(" in line:
            continue
        counts[found.group("op")] += 1
        sizes[found.group("op")] += _shape_bytes(found.group("shape"))
    return {kind: (counts[kind], sizes[kind]) for kind in sorted(counts)}


def cost_of(compiled: Any) -> Cost:
    """The :class:`Cost` of a ``jax.stages.Compiled`` program."""
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    memory = compiled.memory_analysis()
    return Cost(
        flops=float(analysis.get("flops", 0.0)),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
        argument_bytes=int(getattr(memory, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(memory, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
        alias_bytes=int(getattr(memory, "alias_size_in_bytes", 0)),
        collectives=collectives(compiled.as_text()),
    )
