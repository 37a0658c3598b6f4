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

BUDGET = {
    "flops": 1.05,
    "bytes_accessed": 1.10,
    "argument_bytes": 1.10,
    "output_bytes": 1.10,
    "temp_bytes": 1.10,
}
"""How much more than Linen NNX may cost, per measure (NNX costing less always passes),
and a mode of NNX than the mode it is compared with; a collective kind's bytes are held
to ``bytes_accessed``'s."""

SCANNED_REMAT_TEMP = 1.50
"""The temporary-memory budget of the rematerialised train step in the scanned layout.

With flax 0.12.12, ``nnx.remat`` inside ``nnx.scan`` keeps more temporary memory than
``nn.remat`` inside ``nn.scan`` for the same blocks, whoever writes them: the same bytes
more whatever the model constrains (84.7 kB for gpt3, 66.6 kB for llama on
``data=2,fsdp=2,tensor=2``), so a larger ratio as constraints shrink both sides: 1.489x
(gpt3) and 1.313x (llama) with the built-ins' activation constraints, 1.237x and 1.160x
without, 1.135x for the contract example's toy-full (written independently), 1.039x and
1.015x on ``fsdp=8``. Dropping remat costs 2.6x."""

COLLECTIVE_FLOOR = 1024
"""Bytes of collectives that cost nothing worth a failure: the counts of a kind may
differ, and its bytes exceed the budget, by collectives moving this much in all (an
independently written NNX side gathered a 64-byte mask once more than Linen)."""

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


def over_budget(
    program: str,
    first: Cost,
    second: Cost,
    *,
    scanned: bool,
    names: tuple[str, str] = ("Linen", "NNX"),
) -> list[str]:
    """Each way ``second``'s ``program`` costs more than ``first``'s beyond :data:`BUDGET`.

    In words, each side called by its name in ``names`` (NNX against Linen by default).
    Memory and flops per measure; per collective kind, the count (equal, unless the
    difference moves at most :data:`COLLECTIVE_FLOOR` bytes) and the bytes. ``scanned``
    gives a rematerialised program (its name ends in ``(remat)``) the temporary-memory
    budget :data:`SCANNED_REMAT_TEMP`.
    """
    problems = []
    budgets = dict(BUDGET)
    if scanned and program.endswith("(remat)"):
        budgets["temp_bytes"] = SCANNED_REMAT_TEMP
    name_a, name_b = names
    for measure, budget in budgets.items():
        a, b = getattr(first, measure), getattr(second, measure)
        if b > a * budget:
            ratio = f" ({b / a:.3f} x)" if a else ""
            problems.append(
                f"{program}: {measure} {name_b} {b:,.0f} > {budget:g} x {name_a} {a:,.0f}{ratio}"
            )
    for kind in sorted(first.collectives.keys() | second.collectives.keys()):
        (count_a, bytes_a), (count_b, bytes_b) = (
            side.collectives.get(kind, (0, 0)) for side in (first, second)
        )
        recounted = count_a != count_b and abs(bytes_b - bytes_a) > COLLECTIVE_FLOOR
        if recounted or bytes_b > bytes_a * BUDGET["bytes_accessed"] + COLLECTIVE_FLOOR:
            problems.append(
                f"{program}: {kind} {name_a} {count_a} op(s) of {bytes_a:,} bytes, "
                f"{name_b} {count_b} op(s) of {bytes_b:,} bytes"
            )
    return problems
