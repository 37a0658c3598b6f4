"""The leaf map: a family's path rules bound to one Linen tree, run both ways.

:func:`build` applies the rules (:data:`~conformance.contract.PathRules`: renames and
:mod:`leaf transforms <conformance.contract.transforms>`) to a Linen tree's paths and
shapes, giving one :class:`Move` per group of leaves. :meth:`LeafMap.canonical` takes a
flat tree in Linen paths to canonical (NNX) paths and layouts, :meth:`LeafMap.own` back.

Both work on every kind of leaf the harness keys by path, each moved by its own twin of
the transform: arrays (sliced, stacked, transposed, reshaped), shapes
(:class:`~conformance.core.trees.LeafSpec`, ``jax.ShapeDtypeStruct``), logical axis names
(a tuple per leaf, or ``None``) and leaf kinds (strings, copied). State leaves that mirror
a parameter (``optimizer/.../mu/<param>``) move with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from conformance.contract import LeafTransform, PathRules, Reshape, Split, Stack, Transpose
from conformance.core.trees import (
    Flat,
    LeafSpec,
    PathMapError,
    check_bijection,
    mirrored_param,
    prefixed,
    rule_patterns,
)

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Move:
    """Linen leaves ``sources`` (of ``shapes``) are NNX leaves ``targets`` by ``rule``.

    ``rule`` is ``None`` for a rename: one leaf, one target, the same layout.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    shapes: tuple[Shape, ...]
    rule: LeafTransform | None = None

    def forward(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        """The leaves of ``targets`` from those of ``sources`` (any kind of leaf)."""
        rule, (leaf, *_) = self.rule, leaves
        if isinstance(rule, Split):
            return tuple(_take(leaf, rule.axis, i) for i in range(len(self.targets)))
        if isinstance(rule, Stack):
            return (_stack(leaves, rule.axis),)
        if isinstance(rule, Transpose):
            return (_transpose(leaf, rule.perm),)
        if isinstance(rule, Reshape):
            return (_reshape(leaf, self.shapes[0], _resolved(rule.shape, self.shapes[0])),)
        return (leaf,)

    def backward(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        """The leaves of ``sources`` from those of ``targets``: :meth:`forward` inverted."""
        rule, (leaf, *_) = self.rule, leaves
        if isinstance(rule, Split):
            return (_stack(leaves, rule.axis),)
        if isinstance(rule, Stack):
            return tuple(_take(leaf, rule.axis, i) for i in range(len(self.sources)))
        if isinstance(rule, Transpose):
            return (_transpose(leaf, tuple(np.argsort(rule.perm))),)
        if isinstance(rule, Reshape):
            return (_reshape(leaf, _resolved(rule.shape, self.shapes[0]), self.shapes[0]),)
        return (leaf,)


@dataclasses.dataclass(frozen=True)
class LeafMap:
    """Every leaf of a Linen tree taken to its canonical path and layout, one move each."""

    moves: tuple[Move, ...]

    @property
    def transforms(self) -> bool:
        """Whether any move changes a layout (a leaf transform matched a leaf)."""
        return any(move.rule is not None for move in self.moves)

    def pairs(self) -> list[tuple[str, str]]:
        """``(Linen path, NNX path)`` for every source and target moved together."""
        return [(s, t) for move in self.moves for s in move.sources for t in move.targets]

    def origins(self) -> dict[str, str]:
        """``{NNX path: the Linen leaves it comes from}``, as reports name them.

        The Linen path; ``a [i]`` for slice ``i`` of a split ``a``; ``a+b`` for a stack.
        """
        return {
            target: "+".join(move.sources) + (f" [{i}]" if len(move.targets) > 1 else "")
            for move in self.moves
            for i, target in enumerate(move.targets)
        }

    def check_covers(
        self,
        nnx_paths: Iterable[str],
        linen_paths: Iterable[str],
        names: tuple[str, str] = ("Linen", "NNX"),
    ) -> None:
        """Raise :class:`PathMapError` unless ``linen_paths`` land on exactly ``nnx_paths``.

        Each Linen leaf of ``linen_paths`` (or each slice of one) must land on one NNX
        leaf, and every NNX leaf must be reached once; the error lists each that does not,
        naming the trees by ``names``.
        """
        linen, origins = set(linen_paths), self.origins()
        mapping = {
            origins[target]: target
            for move in self.moves
            if move.sources[0] in linen
            for target in move.targets
        }
        check_bijection(mapping, nnx_paths, names)

    def canonical(self, flat: Mapping[str, Any]) -> Flat:
        """``flat`` (Linen paths, any kind of leaf) in canonical paths and layouts."""
        return _apply(flat, {s: m for m in self.moves for s in m.sources}, forward=True)

    def own(self, flat: Mapping[str, Any]) -> Flat:
        """``flat`` (canonical paths and layouts) back in Linen paths and layouts."""
        return _apply(flat, {t: m for m in self.moves for t in m.targets}, forward=False)


def build(rules: PathRules, shapes: Mapping[str, Shape]) -> LeafMap:
    """The leaf map of a Linen tree of ``shapes`` (``{path: shape}``) under ``rules``.

    The first rule whose pattern matches a path takes it; a path no rule matches keeps its
    name. Raises :class:`PathMapError` naming the rule when a transform does not fit its
    leaves (a split axis of the wrong size, a stack missing a part, unequal shapes) or two
    leaves land on one path.
    """
    compiled = [_compile(rule) for rule in rules]
    moves: list[Move] = []
    stacks: dict[tuple[int, str], dict[int, str]] = {}
    for path, shape in shapes.items():
        for index, (rule, patterns) in enumerate(compiled):
            part = next((i for i, p in enumerate(patterns) if p.search(path)), None)
            if part is None:
                continue
            if isinstance(rule, Stack):
                target = patterns[part].sub(rule.into, path, count=1)
                parts = stacks.setdefault((index, target), {})
                if part in parts:
                    raise PathMapError(
                        f"{rule} stacks both {parts[part]} and {path} as part {part} of {target}"
                    )
                parts[part] = path
            else:
                moves.append(_bound(rule, patterns[0], path, tuple(shape)))
            break
        else:
            moves.append(Move((path,), (path,), (tuple(shape),)))
    for (index, target), parts in stacks.items():
        moves.append(_stacked(compiled[index][0], target, parts, shapes))
    _check_one_to_one(moves)
    return LeafMap(tuple(moves))


def _compile(rule: Sequence[str] | LeafTransform) -> tuple[Any, list[re.Pattern[str]]]:
    """The rule as moves bind it (a rename as its replacement), with its patterns."""
    return (rule if isinstance(rule, LeafTransform) else rule[1]), rule_patterns(rule)


def _bound(rule: Any, pattern: re.Pattern[str], path: str, shape: Shape) -> Move:
    if isinstance(rule, str):
        return Move((path,), (pattern.sub(rule, path, count=1),), (shape,))
    if isinstance(rule, Split):
        targets = tuple(pattern.sub(r, path, count=1) for r in rule.into)
        if not -len(shape) <= rule.axis < len(shape) or shape[rule.axis] != len(targets):
            raise PathMapError(
                f"{rule} cannot split {path} of shape {list(shape)}: axis {rule.axis} "
                f"must have {len(targets)} entries, one per target"
            )
        return Move((path,), targets, (shape,), rule)
    target = pattern.sub(rule.into, path, count=1)
    if isinstance(rule, Transpose) and sorted(rule.perm) != list(range(len(shape))):
        raise PathMapError(f"{rule} cannot transpose {path} of shape {list(shape)}")
    if isinstance(rule, Reshape):
        _resolved(rule.shape, shape, f"{rule} cannot reshape {path}")
    return Move((path,), (target,), (shape,), rule)


def _stacked(rule: Stack, target: str, parts: Mapping[int, str], shapes: Mapping) -> Move:
    missing = [rule.parts[i] for i in range(len(rule.parts)) if i not in parts]
    if missing:
        raise PathMapError(
            f"{rule} stacks {target} from {sorted(parts.values())} but no leaf matches {missing}"
        )
    sources = tuple(parts[i] for i in range(len(rule.parts)))
    found = tuple(tuple(shapes[s]) for s in sources)
    if len(set(found)) != 1:
        raise PathMapError(f"{rule} cannot stack {list(sources)} of shapes {found}")
    if not -len(found[0]) - 1 <= rule.axis <= len(found[0]):
        raise PathMapError(f"{rule} cannot stack leaves of shape {list(found[0])} on that axis")
    return Move(sources, (target,), found, rule)


def _check_one_to_one(moves: Sequence[Move]) -> None:
    seen: dict[str, str] = {}
    for move in moves:
        for target in move.targets:
            if target in seen:
                raise PathMapError(
                    f"path rules map both {seen[target]!r} and {move.sources[0]!r} to "
                    f"{target!r}; the map must be one-to-one"
                )
            seen[target] = move.sources[0]


def _resolved(shape: Shape, source: Shape, problem: str = "") -> Shape:
    size, known = math.prod(source), math.prod(d for d in shape if d != -1)
    free = [i for i, d in enumerate(shape) if d == -1]
    if len(free) > 1 or known == 0 or (size % known if free else size != known):
        raise PathMapError(f"{problem or 'cannot reshape'}: {list(source)} -> {list(shape)}")
    return tuple(size // known if d == -1 else d for d in shape)


def _apply(flat: Mapping[str, Any], index: Mapping[str, Move], forward: bool) -> Flat:
    """``flat`` with every group of leaves under one prefix moved by its move's direction.

    Leaves keep ``flat``'s order; a group's leaves come where its first leaf was.
    """
    groups: dict[tuple[str, Move], dict[str, Any]] = {}
    order: list[str | tuple[str, Move]] = []
    for path, leaf in flat.items():
        found = mirrored_param(path, index)
        if found is None:
            order.append(path)
            continue
        key = (found[0], index[found[1]])
        if key not in groups:
            order.append(key)
        groups.setdefault(key, {})[found[1]] = leaf
    result: Flat = {}
    for entry in order:
        if isinstance(entry, str):
            result[entry] = flat[entry]
            continue
        prefix, move = entry
        have = groups[entry]
        ins, outs = (move.sources, move.targets) if forward else (move.targets, move.sources)
        if set(have) != set(ins):
            where = f" under {prefix}" if prefix else ""
            raise PathMapError(f"{sorted(have)}{where} must move together with all of {list(ins)}")
        leaves = (move.forward if forward else move.backward)([have[p] for p in ins])
        result |= {prefixed(prefix, p): leaf for p, leaf in zip(outs, leaves, strict=True)}
    return result


def _take(leaf: Any, axis: int, i: int) -> Any:
    if isinstance(leaf, str) or leaf is None:
        return leaf
    if isinstance(leaf, tuple):
        at = axis % len(leaf)
        return leaf[:at] + leaf[at + 1 :]
    if isinstance(leaf, (LeafSpec, jax.ShapeDtypeStruct)):
        shape = _take(tuple(leaf.shape), axis, i)
        return _with_shape(leaf, shape, lambda spec: _take(spec, axis, i))
    return leaf[(slice(None),) * (axis % leaf.ndim) + (i,)]


def _stack(leaves: Sequence[Any], axis: int) -> Any:
    first = leaves[0]
    if isinstance(first, str) or first is None:
        return first
    if isinstance(first, tuple):
        at = axis % (len(first) + 1)
        return (*first[:at], None, *first[at:])
    if isinstance(first, (LeafSpec, jax.ShapeDtypeStruct)):
        shape = tuple(first.shape)
        at = axis % (len(shape) + 1)
        stacked = (*shape[:at], len(leaves), *shape[at:])
        return _with_shape(first, stacked, lambda spec: _stack([spec], axis))
    return (np if isinstance(first, np.ndarray) else jnp).stack(leaves, axis=axis)


def _transpose(leaf: Any, perm: Sequence[int]) -> Any:
    if isinstance(leaf, str) or leaf is None:
        return leaf
    if isinstance(leaf, tuple):
        return tuple(leaf[p] for p in perm)
    if isinstance(leaf, (LeafSpec, jax.ShapeDtypeStruct)):
        shape = _transpose(tuple(leaf.shape), perm)
        return _with_shape(leaf, shape, lambda spec: _transpose(spec, perm))
    return (np if isinstance(leaf, np.ndarray) else jnp).transpose(leaf, tuple(perm))


def _reshape(leaf: Any, source: Shape, target: Shape) -> Any:
    if isinstance(leaf, str) or leaf is None:
        return leaf
    if isinstance(leaf, tuple):
        return _renamed(leaf, source, target)
    if isinstance(leaf, (LeafSpec, jax.ShapeDtypeStruct)):
        return _with_shape(leaf, target, lambda spec: _renamed(spec, source, target))
    return leaf.reshape(target)


def _with_shape(
    leaf: LeafSpec | jax.ShapeDtypeStruct, shape: Shape, names: Callable[[tuple], tuple]
) -> Any:
    """``leaf`` of ``shape``; an abstract array's mesh axes moved as ``names`` moves names."""
    if isinstance(leaf, LeafSpec):
        return dataclasses.replace(leaf, shape=shape)
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        spec = (*sharding.spec, *(None,) * (len(leaf.shape) - len(sharding.spec)))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*names(spec)))
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)


def _renamed(names: tuple[Any, ...], source: Shape, target: Shape) -> tuple[Any, ...]:
    """Logical names of ``source``'s axes carried to ``target``'s, group by group.

    Axes of size 1 hold no name on either side. The others are grouped where their
    sizes multiply to the same (``[D, H*K]`` and ``[D, H, K]``): a split axis's name goes
    to the group's major axis; merged axes keep their major axis's name, and only when
    none of the others has one.
    """
    kept = [(n, d) for n, d in zip(names, source, strict=True) if d != 1]
    inner = [d for d in target if d != 1]
    carried = iter(_grouped([n for n, _ in kept], [d for _, d in kept], inner, names, source))
    return tuple(None if d == 1 else next(carried) for d in target)


def _grouped(
    names: list[Any], source: list[int], target: list[int], given: Any, shape: Shape
) -> list[Any]:
    result: list[Any] = []
    i = j = 0
    while i < len(source):
        group_in, group_out = [i], [j]
        a, b = source[i], target[j]
        while a != b:
            if a < b:
                i += 1
                group_in.append(i)
                a *= source[i]
            else:
                j += 1
                group_out.append(j)
                b *= target[j]
        if any(names[k] is not None for k in group_in[1:]):
            merged = [names[k] for k in group_in]
            raise PathMapError(
                f"logical names {given} cannot follow a reshape of {list(shape)}: axes named "
                f"{merged} merge into one"
            )
        result += [names[group_in[0]], *[None] * (len(group_out) - 1)]
        i, j = i + 1, j + 1
    return result
