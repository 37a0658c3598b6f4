"""A recorded side: a backend's numbers kept on disk, replayed where a live side computes.

A :class:`RecordedSide` stands in a comparison where a live backend would: it has a
name (``recorded Linen``), canonical parameters and a batch, and for those exactly the
logits, train steps, decode and quantized logits its backend computed when the reference
was recorded (:mod:`conformance.runtime.recording`). It computes nothing: a live side
is given its parameters and batch, and what the live side computes is compared with what
the recording holds, through the same kernel and tolerance policy as two live sides.

Leaves recorded by an earlier release reach the current one through the family's
:meth:`~conformance.contract.Family.upgrade_reference` hook (renamed, moved, reshaped
or re-collected leaves).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from conformance.contract import Batch, Family, upgrade_reference
from conformance.core.environment import library_versions
from conformance.core.references import Reference, ReferenceError, directory, read
from conformance.core.trees import Flat
from conformance.runtime.live import SIDES
from conformance.runtime.recording import FORMAT, train_prefix

RECORD_COMMAND = "python -m conformance.record"
"""The command that writes references (:mod:`conformance.cli.record`)."""


def _under(arrays: Mapping[str, np.ndarray], prefix: str) -> Flat:
    """The arrays under ``prefix/``, keyed by the rest of their name."""
    start = f"{prefix}/"
    return {k.removeprefix(start): v for k, v in arrays.items() if k.startswith(start)}


@dataclasses.dataclass(frozen=True, eq=False)
class RecordedSide:
    """What ``backend`` computed for ``family``, as recorded in ``reference``."""

    family: Family
    backend: str
    reference: Reference

    @property
    def name(self) -> str:
        """How reports name it: ``recorded Linen``."""
        return f"recorded {SIDES[self.backend].name}"

    @property
    def versions(self) -> Mapping[str, str]:
        """The library (and model) versions it was recorded with."""
        return self.reference.manifest["versions"]

    @property
    def label(self) -> str:
        """``recorded Linen (flax 0.12.12, jax 0.12.0.1)``: what a live side is compared with."""
        versions = self.versions
        shown = [f"{k} {versions[k]}" for k in ("maxtext", "flax", "jax") if k in versions]
        return f"{self.name} ({', '.join(shown)})"

    @property
    def layout(self) -> str:
        """The layer layout it was recorded in (``loop`` or ``scan``)."""
        return self.reference.manifest["layout"]

    def version_changes(self) -> list[str]:
        """``"jax 0.12.0.1 -> 0.12.1"`` for each library whose version changed since."""
        now = library_versions()
        return [
            f"{name} {was} -> {now.get(name, 'not installed')}"
            for name, was in sorted(self.versions.items())
            if now.get(name) != was
        ]

    def _upgraded(self, leaves: Flat) -> Flat:
        return upgrade_reference(self.family, leaves, self.versions)

    @functools.cached_property
    def _param_paths(self) -> tuple[str, ...]:
        return tuple(_under(self.reference.arrays, "params"))

    def params(self) -> Flat:
        """The parameters it started from, in the current release's canonical paths."""
        return self._upgraded(_under(self.reference.arrays, "params"))

    def batch(self) -> Batch:
        """The batch it computed on (host arrays)."""
        return Batch(**_under(self.reference.arrays, "batch"))

    def logits(self, what: str) -> np.ndarray | None:
        """Recorded logits: ``forward/float32``, ``forward/bfloat16`` or ``quant/<mode>``."""
        return self.reference.arrays.get(what)

    @property
    def steps(self) -> int:
        """Train steps recorded."""
        return int(self.reference.manifest["train_steps"])

    def trained_in(self, dtype: str = "float32", *, state: bool = False) -> bool:
        """Whether it holds train steps in compute dtype ``dtype`` (``float32``, ``bfloat16``).

        With ``state``: and the whole state after step 1. A reference recorded before
        bfloat16 steps were recorded holds float32 only.
        """
        prefix = train_prefix(dtype)
        arrays = self.reference.arrays
        held = f"{prefix}/1/loss" in arrays
        return held and (not state or any(n.startswith(f"{prefix}/1/state/") for n in arrays))

    def step(self, step: int, dtype: str = "float32") -> tuple[Any, Flat]:
        """Step ``step``'s ``(loss, grads)`` in compute ``dtype``, in current canonical paths."""
        arrays, prefix = self.reference.arrays, f"{train_prefix(dtype)}/{step}"
        return arrays[f"{prefix}/loss"], self._upgraded(_under(arrays, f"{prefix}/grads"))

    def state_as_recorded(self, dtype: str = "float32") -> Flat:
        """The whole train state after step 1 in compute ``dtype``, in the recording's paths."""
        return _under(self.reference.arrays, f"{train_prefix(dtype)}/1/state")

    def state_after_first_step(self, dtype: str = "float32") -> Flat:
        """The whole train state after step 1 in compute ``dtype``, in current canonical paths.

        Each parameter-shaped slot (``model/``, each optimizer moment) is upgraded on its
        own; other leaves (counts, the step counter) are kept as recorded.
        """
        state = self.state_as_recorded(dtype)
        slots: dict[str, Flat] = {}
        rest = {}
        for path, value in state.items():
            param = next((p for p in self._param_paths if path.endswith(f"/{p}")), None)
            if param is None:
                rest[path] = value
            else:
                slots.setdefault(path.removesuffix(param), {})[param] = value
        for prefix, leaves in slots.items():
            rest |= {f"{prefix}{p}": v for p, v in self._upgraded(leaves).items()}
        return rest

    def state_kinds(self) -> Mapping[str, str]:
        """Each recorded state leaf's kind (``Param``, ``OptState``, a Variable type's name)."""
        return self.reference.manifest.get("state_kinds", {})

    def decoded(self) -> Flat | None:
        """``lengths``, ``prefill``, ``steps`` and ``tokens`` of its decode, if recorded."""
        found = _under(self.reference.arrays, "decode")
        return found or None


class MissingReference(ReferenceError):
    """A family declares a recorded backend whose reference is missing or unreadable."""


def load(family: Family, backend: str, root: Path) -> RecordedSide:
    """The reference of ``family`` recorded from ``backend`` under ``root``.

    Raises :class:`MissingReference` in one line, with the command that records it,
    when the files are missing, corrupted or belong to another family, size or backend.
    """
    where = directory(root, family.name, backend)
    again = f"record it with: {RECORD_COMMAND} --family {family.name} --backend {backend}"
    try:
        reference = read(where)
    except ReferenceError as err:
        raise MissingReference(f"{err}; {again}") from None
    manifest = reference.manifest
    expected = {
        "format": FORMAT,
        "family": family.name,
        "size": family.device_size,
        "backend": backend,
    }
    wrong = {k: manifest.get(k) for k, v in expected.items() if manifest.get(k) != v}
    if wrong:
        raise MissingReference(f"{where}: manifest says {wrong}, expected {expected}; {again}")
    return RecordedSide(family, backend, reference)
