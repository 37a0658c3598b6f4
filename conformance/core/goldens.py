"""Reviewed golden files: their format, normalisation, and reading one back.

Goldens are JSON with sorted keys and one leaf per line, so a review of a golden diff is
a review of the change. Where they live and how they are written is the pytest plugin's
business (:mod:`conformance.pytest_plugin.goldens`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

SUFFIX = ".json"


class GoldenError(ValueError):
    """A golden file is missing, unreadable or not valid golden JSON."""


def normalise(value: Any) -> Any:
    """Convert ``value`` to plain JSON types: dicts with str keys, lists, str, int, float.

    PartitionSpec becomes a list, dtypes become their names, numpy scalars and arrays
    become Python numbers and lists, and a non-finite float becomes the string ``"nan"``,
    ``"inf"`` or ``"-inf"`` so no NaN literal is ever written.
    """
    if isinstance(value, dict):
        return {str(k): normalise(v) for k, v in value.items()}
    if isinstance(value, PartitionSpec):
        return [list(e) if isinstance(e, tuple) else e for e in value]
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    if isinstance(value, np.ndarray):
        return normalise(value.tolist())
    if isinstance(value, np.generic):
        return normalise(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} to a golden: {value!r}")


def _is_flat(value: Any) -> bool:
    children = value.values() if isinstance(value, dict) else value
    return not any(isinstance(v, dict) for v in children)


def dumps(value: Any, indent: int = 0) -> str:
    """Golden JSON text: sorted keys, one leaf record per line.

    Nested dicts are indented; a value with no dict inside it (a leaf's record) is
    written on one line.
    """
    if not isinstance(value, dict) or (_is_flat(value) and indent):
        return json.dumps(value, sort_keys=True, separators=(", ", ": "))
    pad = "  " * (indent + 1)
    items = [f"{pad}{json.dumps(k)}: {dumps(value[k], indent + 1)}" for k in sorted(value)]
    return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"


def load(path: Path) -> Any:
    """Read a golden file; a :class:`GoldenError` names the file if it is missing or corrupt."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GoldenError(f"missing golden {path}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise GoldenError(f"corrupted golden {path}: {err}") from None


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Every difference between two golden values, one line each: ``path: old -> new``.

    Dicts are compared key by key (``path: added new`` / ``path: removed old`` for a key
    on one side only); any other value is compared whole, so a leaf record that changed
    is one line. Empty when they are equal.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(old.keys() | new.keys()):
            where = f"{path}/{key}" if path else str(key)
            if key not in new:
                found.append(f"{where}: removed {json.dumps(old[key], sort_keys=True)}")
            elif key not in old:
                found.append(f"{where}: added {json.dumps(new[key], sort_keys=True)}")
            else:
                found += changes(old[key], new[key], where)
        return found
    if old == new:
        return []
    was, now = (json.dumps(v, sort_keys=True) for v in (old, new))
    return [f"{path or '(whole golden)'}: {was} -> {now}"]
