"""Golden files in a run: where each lives, how syrupy writes it, which are unused.

Goldens live at ``<root>/<family>/<check>/<case>.json``: the path is derived from what
the golden depends on (family, check, mesh, layout), never from the test file's
location, so a test can move without orphaning its goldens.

syrupy never sees a golden it was not asked for (the extension discovers nothing), so
regenerating a subset (``--snapshot-update`` with ``-k`` or a node id) writes what it ran
and deletes nothing. Unused goldens are reported by the plugin instead
(:func:`unused_goldens`), and only a person deletes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from syrupy.data import SnapshotCollections
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode
from syrupy.location import PyTestLocation
from syrupy.types import SerializableData, SnapshotIndex

from conformance.core.goldens import SUFFIX, GoldenError, dumps, load, normalise
from conformance.core.references import MANIFEST, references_root
from conformance.pytest_plugin import options

WRITTEN = pytest.StashKey[set[Path]]()
"""The goldens a ``--snapshot-update`` run wrote or found unchanged (their paths)."""


class Golden:
    """The golden file of one test: fails clearly when missing or corrupt, else matches.

    In a multi-controller run that regenerates goldens, process 0 writes them and the
    other processes (``written_elsewhere``) compare nothing.
    """

    def __init__(
        self,
        snapshot: Any,
        root: Path,
        path: Path,
        update: bool,
        written_elsewhere: bool = False,
        *,
        family: str,
        check: str,
        written: set[Path] | None = None,
        options: str = "",
    ) -> None:
        self._snapshot = snapshot.use_extension(GoldenExtension.for_root(root))
        self.root, self.path, self.update = root, path, update
        self.regenerate = (
            f"python -m conformance --family {family} {options}-m golden --snapshot-update "
            f'--tier full -k "{check} and {path.stem}"'
        )
        """The command that writes this golden alone."""
        self.written_elsewhere = written_elsewhere
        self.written = written
        """Where a regenerated golden's path is added, once written or confirmed."""

    def check(self, data: Any) -> None:
        """Assert that ``data``, normalised, equals the golden (or write it when updating)."""
        if self.written_elsewhere:
            return
        if not self.update and (problem := _unreadable(self.path)):
            pytest.fail(
                f"{problem}\n  regenerate with: {self.regenerate} and "
                "review the diff before committing",
                pytrace=False,
            )
        index = self.path.relative_to(self.root).with_suffix("").as_posix()
        assert self._snapshot(name=index) == data
        if self.update and self.written is not None:
            self.written.add(self.path)


def _unreadable(path: Path) -> str:
    """Why the golden at ``path`` cannot be used (missing or corrupted), or ``""``."""
    try:
        load(path)
    except GoldenError as err:
        return str(err)
    return ""


class GoldenExtension(SingleFileSnapshotExtension):
    """syrupy extension writing one golden JSON file per ``(family, check, case)``.

    The snapshot index passed by :class:`Golden` is the file path
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


def unused_goldens(
    config: pytest.Config, root: Path, claimed: set[Path], families: set[str]
) -> list[Path]:
    """Golden files under ``root`` no collected test claims, within what this run could claim.

    A recorded reference counts as its manifest, claimed by the checks that compare with
    it: one a family no longer declares (or of a family that is gone) is unused too.

    A run narrowed by node id, by ``--mesh``/``--topology`` or by ``--tpu`` slices other
    than ``default`` checks nothing (it cannot know what the rest of the suite claims);
    a run narrowed by ``--family`` checks only those families (``families`` are the
    run's); ``-k``/``-m`` do not narrow (claims are taken before deselection).
    """
    narrowed = any("::" in arg for arg in config.args)
    narrowed |= any(value != "default" for value in options.value(config, "tpu") or ())
    if narrowed or options.value(config, "mesh") or options.value(config, "topology"):
        return []
    references = references_root(root)
    goldens = {p for p in claimed if not p.is_relative_to(references)}
    folders = {p.parent for p in goldens}
    on_disk = {p for folder in folders for p in folder.glob(f"*{SUFFIX}")}
    recorded = {p.parent.parent.name for p in claimed - goldens}
    manifests = set(references.glob(f"*/*/{MANIFEST}"))
    on_disk |= {p for p in manifests if p.parent.parent.name in recorded}
    if not options.value(config, "family") and claimed:
        on_disk |= {
            p
            for p in root.rglob(f"*{SUFFIX}")
            if p.relative_to(root).parts[0] not in families and not p.is_relative_to(references)
        }
        on_disk |= {p for p in manifests if p.parent.parent.name not in families}
    return sorted(on_disk - claimed)
