"""Canonical leaf paths, the Linen -> NNX path map, and structure diffs.

A canonical path is the slash-joined key path of a leaf relative to its collection:
``"layers_0/attn/qkv/kernel"`` for Linen ``params``, ``"layers/0/attn/qkv/kernel"`` for an
NNX ``nnx.Param`` state. Everything the harness compares is keyed by these strings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from conformance.families import PathRules

Flat = dict[str, Any]


class PathMapError(ValueError):
    """A family's path rules do not give a one-to-one map between the two trees."""


def _key_str(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def join_path(keys: Iterable[Any]) -> str:
    """Join jax key-path entries or plain keys into a canonical ``a/b/0/c`` path."""
    return "/".join(_key_str(k) for k in keys)


def flatten(tree: Any, is_leaf: Any = None) -> Flat:
    """Flatten a pytree (e.g. Linen ``params``) to ``{canonical path: leaf}``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
    return {join_path(path): leaf for path, leaf in leaves}


def flatten_state(state: nnx.State) -> dict[str, nnx.Variable]:
    """Flatten an NNX state to ``{canonical path: Variable}`` (the Variable, not its value)."""
    return {join_path(path): var for path, var in nnx.to_flat_state(state)}


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the nested dict a Linen collection uses from ``{canonical path: leaf}``."""
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def map_paths(rules: PathRules, linen_paths: Iterable[str]) -> dict[str, str]:
    """Apply a family's regex rewrites to every Linen path: ``{linen path: nnx path}``.

    The first rule whose pattern matches rewrites the path; a path no rule matches maps to
    itself. Two Linen paths that land on one NNX path raise :class:`PathMapError`, since
    the map must be one-to-one.
    """
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    for path in linen_paths:
        target = path
        for pattern, repl in compiled:
            if pattern.search(path):
                target = pattern.sub(repl, path, count=1)
                break
        if target in seen:
            raise PathMapError(
                f"path rules map both {seen[target]!r} and {path!r} to {target!r}; "
                "the map must be one-to-one"
            )
        seen[target] = path
        mapping[path] = target
    return mapping


def check_bijection(mapping: Mapping[str, str], nnx_paths: Iterable[str]) -> None:
    """Raise :class:`PathMapError` unless ``mapping`` covers every NNX path exactly once."""
    targets = set(mapping.values())
    nnx_set = set(nnx_paths)
    unmapped = sorted(nnx_set - targets)
    dangling = sorted(f"{src} -> {dst}" for src, dst in mapping.items() if dst not in nnx_set)
    if unmapped or dangling:
        lines = ["the path map is not a bijection between the Linen and NNX trees:"]
        lines += [f"  NNX leaf with no Linen source: {p}" for p in unmapped]
        lines += [f"  Linen leaf mapped to no NNX leaf: {p}" for p in dangling]
        raise PathMapError("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one leaf: what the structure check compares."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, leaf: Any) -> LeafSpec:
        """The spec of an array, a ``ShapeDtypeStruct`` or an NNX Variable holding either.

        A Variable holding a tuple (as sown intermediates do) is described by its first
        array.
        """
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not hasattr(value, "shape"):
            value = jax.tree.leaves(value)[0]
        return cls(tuple(int(d) for d in value.shape), str(np.dtype(value.dtype)))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def specs(flat: Mapping[str, Any]) -> dict[str, LeafSpec]:
    """``{path: LeafSpec}`` for a flat tree of arrays, structs or Variables."""
    return {path: LeafSpec.of(leaf) for path, leaf in flat.items()}


def structure_diff(
    linen: Mapping[str, LeafSpec], nnx_: Mapping[str, LeafSpec], mapping: Mapping[str, str]
) -> list[str]:
    """Every disagreement between the two trees, one line each, keyed by the NNX path.

    Lists leaves present on only one side and leaves whose shape or dtype differ; an
    empty list means the trees agree leaf for leaf.
    """
    problems = []
    mapped = {mapping.get(path, path): (path, spec) for path, spec in linen.items()}
    for nnx_path in sorted(set(mapped) | set(nnx_)):
        if nnx_path not in nnx_:
            src, spec = mapped[nnx_path]
            problems.append(f"{nnx_path}: Linen has it (as {src}, {spec}); NNX does not")
        elif nnx_path not in mapped:
            problems.append(f"{nnx_path}: NNX has it ({nnx_[nnx_path]}); Linen does not")
        elif mapped[nnx_path][1] != nnx_[nnx_path]:
            src, spec = mapped[nnx_path]
            problems.append(f"{nnx_path}: Linen {spec} (as {src}) != NNX {nnx_[nnx_path]}")
    return problems


def stack_layers(flat: Mapping[str, Any], rules: PathRules) -> Flat:
    """Stack per-layer leaves into the scanned layout described by ``rules``.

    A path matching a rule (index in group ``layer``) is renamed by the rule and stacked
    with the same-named leaves of the other layers, in index order, on a new axis 0;
    other paths pass through. Raises :class:`PathMapError` if a stack has gaps.
    """
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]
    stacks: dict[str, dict[int, Any]] = {}
    result: Flat = {}
    for path, leaf in flat.items():
        for pattern, repl in compiled:
            match = pattern.search(path)
            if match:
                stacks.setdefault(pattern.sub(repl, path, count=1), {})[int(match["layer"])] = leaf
                break
        else:
            result[path] = leaf
    for path, layers in stacks.items():
        if sorted(layers) != list(range(len(layers))):
            raise PathMapError(f"layers of {path} are not 0..n-1: found {sorted(layers)}")
        result[path] = np.stack([np.asarray(layers[i]) for i in range(len(layers))])
    return result
