"""Canonical leaf paths, the Linen -> NNX path map, and structure diffs.

A canonical path is the slash-joined key path of a leaf relative to its collection:
``"layers_0/attn/qkv/kernel"`` for Linen ``params``, ``"layers/0/attn/qkv/kernel"`` for an
NNX ``nnx.Param`` state. Everything the harness compares is keyed by these strings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from conformance.contract import LeafTransform, PathRules, Stack
from conformance.core.distributed import host_array

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


def variable_kind(var: nnx.Variable) -> str:
    """A Variable's type as ``module.qualname``, noting a sown intermediate.

    A sow under a string name (``self.sow("stats", ...)``) makes a Variable type of that
    name on the fly, which is not ``nnx.Intermediate``: it reads ``flax.nnx.variablelib.stats``.
    """
    kind = f"{type(var).__module__}.{type(var).__qualname__}"
    return kind + (" (a sown intermediate)" if isinstance(var, nnx.Intermediate) else "")


def refill(abstract: Any, flat: Mapping[str, Any], prefix: str = "") -> Any:
    """``abstract`` (any pytree) with each leaf replaced by ``flat[prefix + its path]``."""
    return jax.tree_util.tree_map_with_path(lambda k, _: flat[prefix + join_path(k)], abstract)


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
    the map must be one-to-one, and so does a path a leaf transform takes: a name alone
    cannot say how its values move (:mod:`conformance.core.leafmap` can).
    """
    compiled = [(rule_patterns(rule), rule) for rule in rules]
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    for path in linen_paths:
        target = path
        for patterns, rule in compiled:
            found = next((p for p in patterns if p.search(path)), None)
            if found is None:
                continue
            if isinstance(rule, LeafTransform):
                raise PathMapError(
                    f"{rule} changes the layout of {path}; this tree is mapped by name only"
                )
            target = found.sub(rule[1], path, count=1)
            break
        if target in seen:
            raise PathMapError(
                f"path rules map both {seen[target]!r} and {path!r} to {target!r}; "
                "the map must be one-to-one"
            )
        seen[target] = path
        mapping[path] = target
    return mapping


def rule_patterns(rule: Sequence[str] | LeafTransform) -> list[re.Pattern[str]]:
    """The patterns a path rule matches paths with: a rename's, or a transform's."""
    if isinstance(rule, Stack):
        return [re.compile(p) for p in rule.parts]
    if isinstance(rule, LeafTransform):
        return [re.compile(rule.pattern)]
    return [re.compile(rule[0])]


def check_bijection(
    mapping: Mapping[str, str],
    nnx_paths: Iterable[str],
    names: tuple[str, str] = ("Linen", "NNX"),
) -> None:
    """Raise :class:`PathMapError` unless ``mapping`` covers every NNX path exactly once.

    ``names`` name the source tree and the target (NNX) tree in the error.
    """
    targets = set(mapping.values())
    nnx_set = set(nnx_paths)
    unmapped = sorted(nnx_set - targets)
    dangling = sorted(f"{src} -> {dst}" for src, dst in mapping.items() if dst not in nnx_set)
    if unmapped or dangling:
        source, target = names
        lines = [f"the path map is not a bijection between the {source} and {target} trees:"]
        lines += [f"  {target} leaf with no {source} source: {p}" for p in unmapped]
        lines += [f"  {source} leaf mapped to no {target} leaf: {p}" for p in dangling]
        raise PathMapError("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one leaf: what the structure check compares."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, leaf: Any) -> LeafSpec:
        """The spec of an array, a ``ShapeDtypeStruct`` or an NNX Variable holding either.

        Typed PRNG keys keep their extended dtype's name (``key<fry>``).

        A Variable holding a tuple (as sown intermediates do) is described by its first
        array.
        """
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not hasattr(value, "shape"):
            value = jax.tree.leaves(value)[0]
        dtype = value.dtype
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            dtype = np.dtype(dtype)
        return cls(tuple(int(d) for d in value.shape), str(dtype))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def specs(flat: Mapping[str, Any]) -> dict[str, LeafSpec]:
    """``{path: LeafSpec}`` for a flat tree of arrays, structs or Variables."""
    return {path: LeafSpec.of(leaf) for path, leaf in flat.items()}


def structure_diff(
    first: Mapping[str, LeafSpec],
    second: Mapping[str, LeafSpec],
    mapping: Mapping[str, str],
    first_held: Mapping[str, str] | None = None,
    second_held: Mapping[str, str] | None = None,
    names: tuple[str, str] = ("Linen", "NNX"),
) -> list[str]:
    """Every disagreement between the two trees, one line each, keyed by the second's path.

    Lists leaves present on only one side and leaves whose shape or dtype differ; an
    empty list means the trees agree leaf for leaf. ``mapping`` takes the first tree's
    paths to the second's. ``first_held`` and ``second_held`` say, at a second-tree path,
    how each side holds a value outside its parameters, in words (``in collection
    'batch_stats', not 'params'``): a parameter missing on one side is then reported as
    held there as something that is not trained or checkpointed as a parameter.
    ``names`` name the two sides.
    """
    first_held, second_held = first_held or {}, second_held or {}
    one, other = names
    unlike = "it will not be trained or checkpointed as a parameter"
    problems = []
    mapped = {mapping.get(path, path): (path, spec) for path, spec in first.items()}
    for path in sorted(set(mapped) | set(second)):
        if path not in second:
            src, spec = mapped[path]
            held = second_held.get(path)
            instead = f"{other} holds it {held}: {unlike}" if held else f"{other} does not"
            source = "" if src == path else f"as {src}, "
            problems.append(f"{path}: {one} has it ({source}{spec}); {instead}")
        elif path not in mapped:
            held = first_held.get(path)
            instead = f"{one} holds it {held}: {unlike}" if held else f"{one} does not"
            problems.append(f"{path}: {other} has it ({second[path]}); {instead}")
        elif mapped[path][1] != second[path]:
            src, spec = mapped[path]
            source = "" if src == path else f" (as {src})"
            problems.append(f"{path}: {one} {spec}{source} != {other} {second[path]}")
    return problems


def mirrored_param(path: str, params: Iterable[str]) -> tuple[str, str] | None:
    """``(prefix, param path)`` if ``path`` ends in a parameter path (longest match first).

    ``model/layers_0/mlp/wi/kernel`` and ``optimizer/opt_state/1/0/mu/layers_0/mlp/wi/kernel``
    both end in the parameter ``layers_0/mlp/wi/kernel``; a step counter ends in none.
    """
    known = set(params)
    parts = path.split("/")
    for i in range(len(parts)):
        suffix = "/".join(parts[i:])
        if suffix in known:
            return "/".join(parts[:i]), suffix
    return None


def prefixed(prefix: str, path: str) -> str:
    """``path`` under ``prefix`` (``model/<path>``), or ``path`` itself for no prefix."""
    return f"{prefix}/{path}" if prefix else path


def layer_table(rules: PathRules, per_layer_paths: Iterable[str]) -> dict[str, list[str]]:
    """``{stacked path: per-layer paths in layer order}`` from a family's stack rules.

    Each rule's pattern captures the layer index in a group named ``layer``. Raises
    :class:`PathMapError` if the layers of a stacked path are not exactly 0..n-1.
    """
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]
    layers: dict[str, dict[int, str]] = {}
    for path in per_layer_paths:
        for pattern, repl in compiled:
            match = pattern.search(path)
            if match:
                stacked = pattern.sub(repl, path, count=1)
                layers.setdefault(stacked, {})[int(match["layer"])] = path
                break
    table = {}
    for stacked, by_index in layers.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise PathMapError(f"layers of {stacked} are not 0..n-1: found {sorted(by_index)}")
        table[stacked] = [by_index[i] for i in range(len(by_index))]
    return table


def restack(
    flat: Mapping[str, Any], table: Mapping[str, list[str]], to_scan: bool, axis: int = 0
) -> Flat:
    """Stack per-layer leaves into the scanned layout (``to_scan``) or split them back.

    ``table`` comes from :func:`layer_table`. Any path ending in one of its parameter
    paths (the parameter itself, or an optimizer moment mirroring it) is converted: its
    layers stacked on a new ``axis`` in layer order, or a stacked leaf split along
    ``axis``. Other paths pass through unchanged.
    """
    result: Flat = {}
    if not to_scan:
        for path, value in flat.items():
            found = mirrored_param(path, table)
            if found is None:
                result[path] = value
                continue
            prefix, stacked = found
            for index, param in enumerate(table[stacked]):
                result[prefixed(prefix, param)] = np.take(host_array(value), index, axis=axis)
        return result
    owner = {param: stacked for stacked, params in table.items() for param in params}
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for path, value in flat.items():
        found = mirrored_param(path, owner)
        if found is None:
            result[path] = value
            continue
        prefix, param = found
        groups.setdefault((prefix, owner[param]), {})[param] = value
    for (prefix, stacked), layers in groups.items():
        result[prefixed(prefix, stacked)] = np.stack(
            [host_array(layers[p]) for p in table[stacked]], axis=axis
        )
    return result
