"""Checkpoint directories: save, strict restore, and Linen <-> NNX conversion.

A checkpoint directory written here holds ``state/``, an orbax PyTree checkpoint (which
``StandardCheckpointer`` restores) of the train state as nested dicts keyed by canonical
path components, and ``conformance.json``, which says what the state is: family, config
size, backend and layer layout. orbax alone restores a renamed leaf as an error but casts
dtypes silently, so :func:`restore` compares the stored layout with the target first and
refuses any missing, extra, reshaped or retyped leaf, naming its path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.metadata.array_metadata_store import Store

from conformance.contract import Backend, Family
from conformance.contract.values import BACKENDS
from conformance.core import distributed
from conformance.core.distributed import host_array
from conformance.core.leafmap import LeafMap
from conformance.core.seams import seam
from conformance.core.trees import (
    Flat,
    LeafSpec,
    PathMapError,
    flatten,
    specs,
    unflatten,
)
from conformance.core.trees import restack as trees_restack
from conformance.runtime.layouts import stacking
from conformance.runtime.paths import checked_leaf_map
from conformance.runtime.train_state import flat_state
from conformance.runtime.training import TRAINERS

FORMAT_VERSION = 1
INFO_FILE = "conformance.json"
STATE_DIR = "state"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt, of another model, or not restorable."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds: which family and size, which backend, which layout."""

    family: str
    size: str
    backend: Backend
    scan_layers: bool

    @property
    def layout(self) -> str:
        """``"scan"`` (layers stacked) or ``"loop"`` (one subtree per layer)."""
        return "scan" if self.scan_layers else "loop"


@functools.cache
def _type_handlers(replica_parallel: bool) -> type_handlers.TypeHandlerRegistry:
    """The standard orbax type handlers, with orbax's replica-parallel writes on or off.

    orbax (off GPUs) splits each replicated shard among the devices holding it, so that
    every host writes a part; it slices the shard with a jitted program per shape and
    device. In one process that spreads no writes and costs hundreds of compiles per
    run; with it off, one replica writes each shard, as orbax does on GPUs. The array
    handler keeps orbax's array metadata store (it records typed PRNG keys).
    """
    kept = [(t, type_handlers.get_type_handler(t)) for t in type_handlers.supported_types()]
    array = type_handlers.ArrayHandler(
        use_replica_parallel=replica_parallel, array_metadata_store=Store()
    )
    return type_handlers.create_type_handler_registry(
        *[(t, handler) for t, handler in kept if t is not jax.Array], (jax.Array, array)
    )


def save(directory: Path, state: Flat, info: CheckpointInfo) -> None:
    """Write ``state`` and ``info`` to a new ``directory``; an existing one is refused.

    The state is written to a temporary sibling first and renamed into place, so a
    failed save never leaves a half-written checkpoint under ``directory``. In a
    multi-controller run every process calls this with its shards of ``state`` and a
    ``directory`` they all share; each writes its own shards and process 0 the rest
    (a replicated shard is split among the processes holding it; in one process, one
    replica writes it whole).
    """
    directory = Path(directory)
    if directory.exists():
        raise CheckpointError(f"{directory} already exists; refusing to write over it")
    staging = directory.with_name(f".{directory.name}.partial")
    if distributed.is_multiprocess():
        # orbax saves a host-local array from every process: keep one copy, as NumPy.
        state = {p: _one_copy(v) for p, v in state.items()}
    leader = distributed.is_leader()
    if leader:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    distributed.barrier(f"save {directory}: staging")
    registry = _type_handlers(replica_parallel=distributed.is_multiprocess())
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(
            staging.absolute() / STATE_DIR, args=ocp.args.PyTreeSave(unflatten(state))
        )
    distributed.barrier(f"save {directory}: state written")
    if leader:
        record = {"format": FORMAT_VERSION, **dataclasses.asdict(info)}
        (staging / INFO_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        staging.rename(directory)
    distributed.barrier(f"save {directory}: in place")


def _one_copy(value: Any) -> Any:
    """``value``, or NumPy for an array held whole by this process (saved by process 0)."""
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        return np.asarray(value)
    return value


def read_info(directory: Path) -> CheckpointInfo:
    """The checkpoint's ``conformance.json``; a :class:`CheckpointError` says what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    path = directory / INFO_FILE
    try:
        record = json.loads(path.read_text())
        if record.pop("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: unsupported format, expected {FORMAT_VERSION}")
        info = CheckpointInfo(**{**record, "backend": Backend(record["backend"])})
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} has no {INFO_FILE}: not a conformance checkpoint"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is corrupted: {err}") from None
    except ValueError:
        raise CheckpointError(
            f"{path}: backend {record['backend']!r} is not one of {BACKENDS}"
        ) from None
    return info


def stored_layout(directory: Path) -> dict[str, LeafSpec]:
    """``{path: LeafSpec}`` of the stored state, read from orbax metadata only."""
    state_dir = Path(directory).absolute() / STATE_DIR
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(state_dir).item_metadata.tree
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CheckpointError(
            f"cannot read checkpoint {state_dir}: {type(err).__name__}: {err}"
        ) from None
    return {
        path: LeafSpec(tuple(meta.shape), str(np.dtype(meta.dtype)))
        for path, meta in flatten(tree, is_leaf=lambda x: hasattr(x, "shape")).items()
    }


def layout_problems(stored: Mapping[str, LeafSpec], target: Mapping[str, LeafSpec]) -> list[str]:
    """Every way ``stored`` differs from ``target``, one line per leaf path."""
    problems = [
        f"{p}: in the target, missing from the checkpoint"
        for p in sorted(target.keys() - stored.keys())
    ]
    problems += [
        f"{p}: in the checkpoint, not in the target" for p in sorted(stored.keys() - target.keys())
    ]
    for path in sorted(stored.keys() & target.keys()):
        if stored[path] != target[path]:
            problems.append(f"{path}: checkpoint {stored[path]} != target {target[path]}")
    return problems


def restore(
    directory: Path,
    target: Mapping[str, LeafSpec],
    shardings: Mapping[str, Sharding] | None = None,
) -> Flat:
    """Restore exactly ``target``'s leaves, placed with ``shardings`` (default: host).

    Raises :class:`CheckpointError` naming every missing, extra, reshaped or retyped
    leaf before reading any data: never a zero-filled leaf, never a silent cast.
    """
    state_dir = Path(directory).absolute() / STATE_DIR
    problems = layout_problems(stored_layout(directory), target)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not match the restore target\n  " + "\n  ".join(problems)
        )
    abstract = {
        path: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=(shardings or {}).get(path))
        for path, spec in target.items()
    }
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = flatten(checkpointer.restore(state_dir, unflatten(abstract)))
    except Exception as err:  # orbax raises many types for damaged data
        raise CheckpointError(f"cannot restore {state_dir}: {type(err).__name__}: {err}") from None
    retyped = [
        f"{p}: restored {LeafSpec.of(v)} != target {target[p]}"
        for p, v in restored.items()
        if LeafSpec.of(v) != target[p]
    ]
    if retyped:
        raise CheckpointError(
            f"checkpoint {directory} restored with other types\n  " + "\n  ".join(retyped)
        )
    return seam("checkpoint_restored", lambda tree: tree)(restored)


def _move(state: Flat, to: Callable[[Flat], Flat]) -> Flat:
    try:
        return to(state)
    except PathMapError as err:
        raise CheckpointError(f"cannot move the state's leaves: {err}") from err


def convert(
    state: Flat, family: Family, source: CheckpointInfo, backend: Backend, scan_layers: bool
) -> tuple[Flat, CheckpointInfo]:
    """Convert a train state between backends and layer layouts.

    The state goes to canonical (NNX) paths, is restacked there if the layout changes
    (:func:`~conformance.runtime.layouts.stacking`: parameters and their optimizer
    moments on one axis, persistent state on another), and then goes to the target
    backend's paths; counters pass through unchanged.
    """
    move = seam("convert_paths", _move)
    restack = seam("convert_restack", trees_restack)
    src_config = family.config(source.size, scan_layers=source.scan_layers)
    dst_config = family.config(source.size, scan_layers=scan_layers)
    if Backend(source.backend) is Backend.LINEN:
        state = move(state, _leaf_map(family, src_config).canonical)
    if source.scan_layers != scan_layers:
        loop, scan = (family.config(source.size, scan_layers=s) for s in (False, True))
        try:
            tables = stacking(family, loop, scan)
        except PathMapError as err:
            raise CheckpointError(f"cannot restack {family.name}: {err}") from err
        state = restack(state, tables.params, scan_layers, tables.axis)
        if tables.state:
            state = restack(state, tables.state, scan_layers, tables.state_axis)
    if Backend(backend) is Backend.LINEN:
        state = move(state, _leaf_map(family, dst_config).own)
    state = seam("convert_cast_counters", cast_counters)(
        state, expected_layout(family, dst_config, backend)
    )
    return state, dataclasses.replace(source, backend=backend, scan_layers=scan_layers)


def _leaf_map(family: Family, config: Any) -> LeafMap:
    try:
        return checked_leaf_map(family, config)
    except PathMapError as err:
        raise CheckpointError(f"cannot convert {family.name}: {err}") from err


def expected_layout(family: Family, config: Any, backend: Backend) -> dict[str, LeafSpec]:
    """``{path: LeafSpec}`` of the train state the harness builds for ``backend``."""
    trainer = TRAINERS[backend](family, config)
    return specs(flat_state(trainer.abstract_state))


def cast_counters(state: Flat, target: Mapping[str, LeafSpec]) -> Flat:
    """Cast integer scalars (step counters) to the target's integer dtype, exactly.

    The one dtype change conversion makes: Linen train states count steps in int32,
    ``nnx.Optimizer`` in uint32. A value the target dtype cannot hold is an error;
    every other leaf keeps its dtype (restore will refuse a mismatch).
    """
    result = dict(state)
    for path, value in state.items():
        want = target.get(path)
        have = host_array(value)
        if want is None or have.shape or want.dtype == str(have.dtype):
            continue
        if not (np.issubdtype(have.dtype, np.integer) and np.issubdtype(want.dtype, np.integer)):
            continue
        cast = have.astype(want.dtype)
        if cast.astype(have.dtype) != have:
            raise CheckpointError(f"{path}: counter {have} does not fit in {want.dtype}")
        result[path] = cast
    return result
