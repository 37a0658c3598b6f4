"""Recorded references on disk: a manifest and an archive of arrays, byte-stable.

A reference is what one backend computed for a family, kept as reviewed files like the
goldens: ``<root>/<family>/<backend>/manifest.json`` (who recorded it, with which
library versions, and every array's name, shape, dtype and digest) and
``<root>/<family>/<backend>/arrays.npz``. Writing the same arrays twice gives the same
bytes (sorted names, fixed timestamps, fixed compression), so a regenerated reference
that did not change shows no diff. Reading checks every array against the manifest: a
missing, truncated or edited file is a one-line :class:`ReferenceError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
ARRAYS = "arrays.npz"
_EPOCH = (1980, 1, 1, 0, 0, 0)
"""Every archive member's timestamp: the zip format's earliest, so bytes never drift."""


class ReferenceError(ValueError):
    """A recorded reference that is missing, unreadable, or does not match its manifest."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """One backend's recorded numbers for a family: a manifest and named host arrays."""

    manifest: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]


def references_root(goldens: Path) -> Path:
    """Where references live: the ``references`` folder of the goldens directory."""
    return goldens / "references"


def directory(root: Path, family: str, backend: str) -> Path:
    """Where the reference of ``family`` recorded from ``backend`` lives under ``root``."""
    return root / family / backend


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def _entry(array: np.ndarray) -> str:
    """``float32[8,32] sha256:<hex>``: one readable manifest line per array."""
    shape = ",".join(str(n) for n in array.shape)
    return f"{array.dtype.name}[{shape}] sha256:{_digest(array)}"


def _archive(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(arrays):
            member = zipfile.ZipInfo(f"{name}.npy", date_time=_EPOCH)
            member.compress_type = zipfile.ZIP_DEFLATED
            data = io.BytesIO()
            np.lib.format.write_array(
                data, np.require(arrays[name], requirements="C"), allow_pickle=False
            )
            archive.writestr(member, data.getvalue(), compresslevel=6)
    return buffer.getvalue()


def encode(reference: Reference) -> dict[str, bytes]:
    """The files of ``reference``, by name: the same arrays always give the same bytes.

    Arrays must be of a standard numpy dtype (the recorder widens bfloat16 to float32).
    """
    for name, array in reference.arrays.items():
        if array.dtype.kind not in "biuf":
            raise ReferenceError(f"{name}: dtype {array.dtype} cannot be recorded")
    manifest = dict(reference.manifest)
    manifest["arrays"] = {name: _entry(reference.arrays[name]) for name in sorted(reference.arrays)}
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return {MANIFEST: text.encode(), ARRAYS: _archive(reference.arrays)}


def write(path: Path, reference: Reference) -> None:
    """Write ``reference`` into directory ``path`` (:func:`encode`'s files)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, data in encode(reference).items():
        (path / name).write_bytes(data)


def read(path: Path) -> Reference:
    """The reference in directory ``path``, every array checked against the manifest.

    Raises :class:`ReferenceError` naming the file and what is wrong with it.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ReferenceError(f"{path / MANIFEST}: no recorded reference here") from None
    except (OSError, ValueError) as err:
        raise ReferenceError(f"{path / MANIFEST}: unreadable ({err})") from None
    listed = manifest.get("arrays")
    if not isinstance(listed, dict):
        raise ReferenceError(f"{path / MANIFEST}: no 'arrays' table; the manifest is corrupted")
    try:
        with zipfile.ZipFile(path / ARRAYS) as archive:
            members = {m.removesuffix(".npy") for m in archive.namelist()}
            if members != set(listed):
                extra, missing = sorted(members - set(listed)), sorted(set(listed) - members)
                raise ReferenceError(
                    f"{path / ARRAYS}: does not match its manifest "
                    f"(unlisted {extra[:3]}, missing {missing[:3]})"
                )
            arrays = {
                name: np.lib.format.read_array(archive.open(f"{name}.npy"), allow_pickle=False)
                for name in sorted(listed)
            }
    except FileNotFoundError:
        raise ReferenceError(f"{path / ARRAYS}: missing beside its manifest") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise ReferenceError(f"{path / ARRAYS}: unreadable ({err})") from None
    for name, array in arrays.items():
        if _entry(array) != listed[name]:
            raise ReferenceError(
                f"{path / ARRAYS}: {name} does not match its manifest entry "
                "(shape, dtype or digest); the file was changed by hand or corrupted"
            )
    manifest.pop("arrays")
    return Reference(manifest, arrays)


INPUTS = ("params/", "batch/")
"""Name prefixes of the arrays a reference computed from (its parameters and batch)."""


def extend(recorded: Reference, fresh: Reference) -> Reference:
    """``recorded`` with the arrays only ``fresh`` holds added, and nothing else changed.

    For a reference recorded by an earlier harness that records less: every recorded
    array and manifest field is kept as it was; the manifest's ``extended`` list gains
    what was added (the names' first components) and the library versions that computed
    it. Raises :class:`ReferenceError` when the two were not computed from the same
    inputs (:data:`INPUTS`), since the added numbers would not belong with the rest.
    Returns ``recorded`` itself when ``fresh`` adds nothing.
    """
    inputs = [
        {n: a for n, a in ref.arrays.items() if n.startswith(INPUTS)} for ref in (recorded, fresh)
    ]
    same = inputs[0].keys() == inputs[1].keys() and all(
        np.array_equal(inputs[0][n], inputs[1][n]) for n in inputs[0]
    )
    if not same:
        raise ReferenceError(
            "the recorded parameters or batch differ from those the recorder starts from "
            "now, so new numbers cannot be added to the old: record it again with --update"
        )
    added = {n: a for n, a in fresh.arrays.items() if n not in recorded.arrays}
    if not added:
        return recorded
    manifest = dict(recorded.manifest)
    entry = {
        "added": sorted({n.split("/", 1)[0] for n in added}),
        "versions": fresh.manifest.get("versions", {}),
    }
    manifest["extended"] = [*manifest.get("extended", []), entry]
    return Reference(manifest, {**recorded.arrays, **added})
