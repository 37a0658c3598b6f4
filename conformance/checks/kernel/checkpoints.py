"""A train state through orbax: restored strictly into a fresh train state.

:func:`restored_into` is how a check resumes from a checkpoint (``resume``, and
``tree_mode`` across NNX's two modes): byte for byte what was saved, or a failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from conformance.core.failure import fail
from conformance.core.numerics import EXACT, compare_trees
from conformance.core.records import failed
from conformance.core.trees import Flat, specs
from conformance.runtime.checkpoints import CheckpointError, restore
from conformance.runtime.stepping import Training
from conformance.runtime.train_state import flat_state


def restored_into(directory: Path, saved: Mapping[str, Any], into: Training, what: str) -> Flat:
    """The train state saved in ``directory`` restored strictly into ``into``; returned.

    Restored in the layout of ``into``'s own train state with ``saved``'s shardings, it
    must be byte for byte ``saved``: a checkpoint that cannot be read, or any leaf that
    differs, fails the check under the title ``what``. ``into`` then holds it, placed.
    """
    layout = specs(flat_state(into.trainer.abstract_state))
    try:
        restored = restore(directory, layout, {p: v.sharding for p, v in saved.items()})
    except CheckpointError as err:
        fail(f"{what}: {err}")
    if mismatches := compare_trees(saved, restored, EXACT):
        fail(failed(what, mismatches, ("saved", "restored")))
    into.state = jax.device_put(into.trainer.tree(restored), into.shardings)
    return restored
