"""Find the first module whose output diverges, with no help from the family.

Both sides run the same forward once more, with every module method call recorded
(:mod:`conformance.runtime.calls`). Each call sends its array inputs and outputs to the
host through ``jax.debug.callback``, so calls inside ``scan`` or ``remat`` bodies are
recorded once per iteration. Modules are paired through the family's path map (a module
is paired with the NNX module that holds exactly the images of its parameters), calls by
method name and call count. The culprit is the first call, in call order, whose inputs
agree and whose output does not: the module that introduced the divergence rather than
one that inherited it.

This runs only when a forward comparison has already failed, so its extra compilation
is never paid by a passing suite.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conformance.contract import Batch, PathRules
from conformance.core.distributed import host_array, is_multiprocess
from conformance.core.numerics import Mismatch, compare_arrays, strictest_tolerance
from conformance.core.sharding import explicit_mode, moved_to
from conformance.core.trees import Flat, PathMapError, map_paths
from conformance.runtime.backends import Runner, mesh_of
from conformance.runtime.calls import ModuleCall

CallKey = tuple[str, str, int]
"""``(module path, method name, how many calls of it came before)``."""


@dataclasses.dataclass
class Call:
    """One recorded module method call: its array inputs and outputs, on the host."""

    order: int
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


class Recorder:
    """Collects calls from host callbacks, keyed by :data:`CallKey`.

    ``order`` is the position of the call's method in trace order (the order the Python
    code ran); calls of one traced method repeated at run time (a scanned body) are
    counted in arrival order.
    """

    def __init__(self, mesh: Mesh | None) -> None:
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self.calls: dict[CallKey, Call] = {}
        self._order: dict[tuple[str, str], int] = {}
        self._count: collections.Counter[tuple[str, str]] = collections.Counter()

    def around(self, call: ModuleCall, run: Callable[[], Any]) -> Any:
        """Run ``call``, then stage a host callback for its values (not in lifted calls)."""
        output = run()
        if not call.lifted:
            self.trace(call.path, call.method, call.args, output)
        return output

    def trace(self, path: str, method: str, args: Any, output: Any) -> None:
        """Called while tracing a method call: stage a host callback for its values."""
        order = self._order.setdefault((path, method), len(self._order))
        inputs, outputs = self._gathered(args), self._gathered(output)
        jax.debug.callback(self._receive, path, method, order, inputs, outputs)

    def _gathered(self, tree: Any) -> list[jax.Array]:
        """``tree``'s arrays replicated first, so the partitioner gathers them cheaply."""
        arrays = _arrays(tree)
        if self._replicated is None:
            return arrays
        if explicit_mode():  # where a sharding constraint only asserts
            return [jax.sharding.reshard(x, PartitionSpec()) for x in arrays]
        return [jax.lax.with_sharding_constraint(x, self._replicated) for x in arrays]

    def _receive(
        self,
        path: str,
        method: str,
        order: int,
        inputs: Sequence[Any],
        outputs: Sequence[Any],
    ) -> None:
        count = self._count[(path, method)]
        self._count[(path, method)] += 1
        self.calls[(path, method, count)] = Call(
            order, [host_array(x) for x in inputs], [host_array(x) for x in outputs]
        )


def _arrays(tree: Any) -> list[jax.Array]:
    """The floating-point array leaves of ``tree``: what can diverge numerically."""
    return [
        leaf
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]


def record(runner: Runner, params: Flat, batch: Batch) -> Recorder:
    """Run ``runner``'s forward once, recording every module method call.

    Linen calls inside a lifted transform (``nn.scan``, ``nn.remat``, ...) are not
    recorded: ``nn.scan`` traces its body once more to find broadcast variables and
    refuses any effect there. The transformed module's own call is recorded.
    """
    mesh = mesh_of(params)
    recorder = Recorder(mesh)
    forward = runner.intercepted(recorder.around)
    context = runner.context(mesh)
    batch = batch if mesh is None else moved_to(batch, mesh)  # a mode's own mesh
    # A new jit on purpose: calls are recorded while tracing, so a cached one records nothing.
    jax.block_until_ready(jax.jit(forward)(runner.pack(params), context, batch))
    jax.effects_barrier()
    return recorder


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _under(prefix: str, path: str) -> bool:
    return prefix == "" or path.startswith(prefix + "/")


def _common_prefix(paths: Sequence[str]) -> str:
    split = [p.split("/") for p in paths]
    common = []
    for parts in zip(*split, strict=False):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return "/".join(common)


def _renamed(rules: PathRules, module: str) -> str:
    """``module`` under the family's path rules; itself where a leaf transform takes it."""
    try:
        return map_paths(rules, [module])[module]
    except PathMapError:
        return module


def module_pairs(
    leaves: Sequence[tuple[str, str]],
    rules: PathRules,
    linen_modules: Sequence[str],
    nnx_modules: Sequence[str],
) -> dict[str, str]:
    """``{Linen module path: NNX module path}`` for every module that has a counterpart.

    A module holding parameters pairs with the NNX module that holds exactly their
    images among ``leaves`` (``(Linen leaf path, NNX leaf path)`` pairs); one holding none
    pairs by the family's renames applied to its path, or by the same path. An NNX
    module holding the images of several Linen modules (a wrapper and its one child, or
    a Linen leaf split across an NNX module's leaves) pairs with the one its path
    renames to, else the outermost.
    """
    nnx_set = set(nnx_modules)
    pairs: dict[str, str] = {}
    claims: dict[str, list[str]] = {}
    for module in linen_modules:
        images = [dst for src, dst in leaves if _under(module, src)]
        if images:
            target = _common_prefix([_parent(p) for p in images])
            owned = [p for _, p in leaves if _under(target, p)]
            if target in nnx_set and sorted(owned) == sorted(images):
                claims.setdefault(target, []).append(module)
            continue
        for candidate in (_renamed(rules, module), module):
            if candidate in nnx_set:
                pairs[module] = candidate
                break
    for target, modules in claims.items():
        named = [module for module in modules if _renamed(rules, module) == target]
        pairs[(named or modules)[0]] = target
    return pairs


Arrays = list[np.ndarray]
"""A call's floating-point inputs or outputs, on the host."""


def _compare(label: str, first: Arrays, second: Arrays) -> Mismatch | None:
    """The first leaf of ``label`` outside tolerance; ``None`` if all agree.

    Two values of other dtypes are compared at the more precise one's tolerance: a side
    that rounds where the other does not has parted from it there, and at the coarser
    tolerance its rounded output would pass on as agreeing inputs to the next call, which
    would then be blamed.
    """
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        found = compare_arrays(f"{label}[{i}]", a, b, strictest_tolerance(a.dtype, b.dtype))
        if found is not None:
            return found
    return None


def _paired(first: Arrays, second: Arrays) -> tuple[Arrays, Arrays] | None:
    """Two calls' inputs or outputs to compare position by position; ``None``: none.

    Where one side has more, the leading arrays both have are compared: a Linen layer
    returns ``(carry, output)`` for ``nn.scan`` where its NNX twin returns the carry.
    """
    n = min(len(first), len(second))
    if n == 0 and len(first) != len(second):
        return None
    if any(a.shape != b.shape for a, b in zip(first[:n], second[:n], strict=True)):
        return None
    return first[:n], second[:n]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a forward first diverges, as found by :func:`first_divergence`."""

    linen_call: CallKey
    nnx_path: str
    mismatch: Mismatch
    inputs_compared: bool
    agreed: int
    """Paired calls before this one whose outputs agree."""
    unpaired_inside: int = 0
    """NNX calls inside this module with no recorded Linen counterpart."""

    def describe(self, names: tuple[str, str] = ("Linen", "NNX")) -> str:
        """Two or more lines naming the module, the method, the call and the worst leaf.

        ``names`` name the two sides (the first is the one whose module paths are shown).
        """
        first, second = names
        path, method, count = self.linen_call
        where = path or "(the top module)"
        nth = f", call {count + 1}" if count else ""
        same = "" if self.nnx_path == path else f" ({second} {self.nnx_path or 'top module'})"
        inputs = (
            "its inputs agree and its output does not"
            if self.inputs_compared
            else "its output differs (its inputs could not be paired, so it may inherit it)"
        )
        inside = (
            f"; {self.unpaired_inside} {second} call(s) inside it have no recorded {first} "
            "counterpart (Linen calls inside nn.scan and other lifted transforms are not "
            "recorded), so the divergence may be anywhere inside it"
            if self.unpaired_inside
            else ""
        )
        return (
            f"first divergent module: {where}{same}, {method}{nth}: {inputs}; "
            f"the {self.agreed} paired call(s) before it agree{inside}\n    "
            + self.mismatch.describe(names).replace("\n", "\n  ")
        )


def first_divergence(
    linen: Recorder,
    nnx_: Recorder,
    leaves: Sequence[tuple[str, str]],
    rules: PathRules,
) -> Divergence | str:
    """The first paired call whose inputs agree and output diverges, or why there is none."""
    linen_modules = sorted({path for path, _, _ in linen.calls})
    nnx_modules = sorted({path for path, _, _ in nnx_.calls})
    pairs = module_pairs(leaves, rules, linen_modules, nnx_modules)
    ordered = sorted(linen.calls.items(), key=lambda kv: (kv[0][2], kv[1].order))
    compared = agreed = 0
    for (path, method, count), call in ordered:
        other = nnx_.calls.get((pairs.get(path, "\0"), method, count))
        outputs = None if other is None else _paired(call.outputs, other.outputs)
        if outputs is None:
            continue
        compared += 1
        found = _compare("output", *outputs)
        if found is None:
            agreed += 1
            continue
        inputs = _paired(call.inputs, other.inputs)
        inputs_known = inputs is not None
        if inputs is not None and _compare("input", *inputs) is not None:
            continue
        target = pairs[path]
        paired = set(pairs.values())
        inside = sum(
            1 for p, _, _ in nnx_.calls if p != target and _under(target, p) and p not in paired
        )
        return Divergence((path, method, count), target, found, inputs_known, agreed, inside)
    if not compared:
        return (
            "no module call could be paired between the sides "
            f"({len(linen.calls)} and {len(nnx_.calls)} calls recorded); cannot localise"
        )
    return (
        f"every one of the {compared} paired module calls agrees: the divergence is "
        "outside the modules (in code between module calls)"
    )


def localise(
    first: Runner,
    second: Runner,
    first_params: Flat,
    second_params: Flat,
    batch: Batch,
    leaves: Sequence[tuple[str, str]],
    rules: PathRules,
) -> Divergence | str:
    """The first divergent module of a forward between the two sides, or why none was found.

    ``first`` is Linen's runner or an NNX one; ``second`` NNX's, whose module paths are
    canonical; ``leaves`` and ``rules`` take the first's paths to the second's.

    Never raises for a model it cannot record this way: the reason is the answer. In a
    multi-controller run it records nothing: the host callbacks fire on one process
    only, and every process must reach the same answer.
    """
    if is_multiprocess():
        return (
            "module outputs are recorded in single-process runs only (host callbacks fire "
            "on one process); rerun this test in one process to find the first divergent module"
        )
    try:
        found = first_divergence(
            record(first, first_params, batch),
            record(second, second_params, batch),
            leaves,
            rules,
        )
    except Exception as err:  # localisation is advice: never a second failure
        reason = re.sub(r"\s+", " ", str(err))[:300]
        return f"module outputs could not be recorded ({type(err).__name__}: {reason})"
    return found
