"""Reviewed golden files: layout, normalisation and the syrupy extension that stores them.

Goldens live at ``<root>/<family>/<check>/<case>.json``: the path is derived from what
the golden depends on (family, check, mesh, layout), never from the test file's
location, so a test can move without orphaning its goldens. Files are JSON with sorted
keys and one leaf per line, so a review of a golden diff is a review of the change.

syrupy never sees a golden it was not asked for (the extension discovers nothing), so
regenerating a subset (``--snapshot-update`` with ``-k`` or a node id) writes what it ran
and deletes nothing. Unused goldens are reported by the plugin instead, and only a
person deletes them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from jax.sharding import PartitionSpec
from syrupy.data import SnapshotCollections
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode
from syrupy.location import PyTestLocation
from syrupy.types import SerializableData, SnapshotIndex

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


def golden_path(root: Path, family: str, check: str, case: str) -> Path:
    """Where the golden of ``check`` for ``family`` and ``case`` lives under ``root``."""
    return root / family / check / f"{case}{SUFFIX}"


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


class GoldenExtension(SingleFileSnapshotExtension):
    """syrupy extension writing one golden JSON file per ``(family, check, case)``.

    The snapshot index passed by :class:`conformance.plugin.Golden` is the file path
    relative to :attr:`root`; syrupy matches the serialised text exactly.
    """

    file_extension = SUFFIX[1:]
    _write_mode = WriteMode.TEXT
    root: ClassVar[Path] = Path("goldens")

    @classmethod
    def for_root(cls, root: Path) -> type[GoldenExtension]:
        """The extension bound to the goldens directory ``root``."""
        return type(cls.__name__, (cls,), {"root": root})

    @classmethod
    def get_location(cls, *, test_location: PyTestLocation, index: SnapshotIndex) -> str:
        """The golden's file: ``index`` is its path relative to :attr:`root`."""
        return str(cls.root / f"{index}{SUFFIX}")

    @classmethod
    def matches_test_location(
        cls, *, test_location: PyTestLocation, snapshot_location: str
    ) -> bool:
        """Goldens are keyed by content, not by test file: any file under the root."""
        return Path(snapshot_location).is_relative_to(cls.root)

    def discover_snapshots(
        self, *, test_location: PyTestLocation, ignore_extensions: list[str] | None = None
    ) -> SnapshotCollections:
        """Nothing: unused goldens are judged by the plugin, so syrupy can never delete one."""
        return SnapshotCollections()

    def serialize(self, data: SerializableData, **kwargs: Any) -> str:
        """Normalised golden JSON text."""
        return dumps(normalise(data)) + "\n"
