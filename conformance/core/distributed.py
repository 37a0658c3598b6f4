"""Multi-controller runs: one process per host, every process running the same program.

On a TPU pod slice JAX runs one process per host (``jax.distributed``); each holds only
its own shards of a global array, so a value is read onto the host with
:func:`host_array`, which gathers it from every process. Collectives are collective:
every process must make the same calls in the same order, which the harness guarantees
by running the same tests in the same order everywhere (:func:`differences` checks it).
With one process every function here is the single-process operation it generalises.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class DistributedError(RuntimeError):
    """A multi-controller run cannot start: a bad address, an unreachable coordinator."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a multi-controller run.

    With ``coordinator`` unset, JAX detects the cluster itself (TPU pod slices, SLURM,
    Kubernetes jobs): the same command then runs unchanged on every host.
    """

    coordinator: str | None = None
    """``host:port`` of process 0's coordination service."""
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = 300
    """How long to wait for the coordinator, for every process to join, for a silent
    process before the run is declared dead, and for every process to finish."""

    def describe(self) -> str:
        """``process I of N (coordinator HOST:PORT)``, or what JAX will detect."""
        if self.coordinator is None:
            return "this process (cluster detected by JAX)"
        return f"process {self.process_id} of {self.num_processes} (coordinator {self.coordinator})"


def initialize(cluster: Cluster) -> None:
    """Join the run ``cluster`` describes; must be called before any JAX computation.

    A process other than 0 first waits for the coordinator's port to accept connections
    and raises :class:`DistributedError` naming itself and the address if it does not
    within ``timeout_s``: JAX itself aborts the process (SIGABRT) on that timeout.
    CPU devices exchange data through gloo, and compile with the persistent compilation
    cache off.
    """
    if cluster.coordinator is not None:
        if cluster.num_processes is None or cluster.process_id is None:
            raise DistributedError(
                f"coordinator {cluster.coordinator} given without both the number of "
                "processes and this process's id"
            )
        if not 0 <= cluster.process_id < cluster.num_processes:
            raise DistributedError(
                f"process id {cluster.process_id} is not in 0..{cluster.num_processes - 1}"
            )
        if cluster.process_id != 0:
            wait_for_port(cluster.coordinator, cluster.timeout_s, cluster.describe())
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            cluster.coordinator,
            cluster.num_processes,
            cluster.process_id,
            initialization_timeout=cluster.timeout_s,
            heartbeat_timeout_seconds=cluster.timeout_s,
            shutdown_timeout_seconds=cluster.timeout_s,
        )
    except (RuntimeError, ValueError) as err:  # e.g. no cluster JAX can detect
        raise DistributedError(f"{cluster.describe()} cannot join the run: {err}") from None
    if jax.devices()[0].platform == "cpu":
        # Executables read back from the persistent cache desynchronise gloo's contexts
        # between the processes (jaxlib 0.12.0.1: "Gloo context initialization failed:
        # GetKeyValue() timed out", "Gloo AllGather failed: Connection reset by peer"),
        # so CPU processes of one run compile afresh, whatever the environment asks.
        jax.config.update("jax_enable_compilation_cache", False)


def wait_for_port(address: str, timeout_s: float, who: str) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise if it does not in time."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedError(f"{who}: coordinator address {address!r} is not host:port")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"{who}: cannot reach the coordinator at {address} within {timeout_s:g} s "
                    f"({err.strerror or err}); is process 0 running, and is the address one "
                    "every host can reach?"
                ) from None
        time.sleep(0.5)


def is_multiprocess() -> bool:
    """Whether this run has more than one process."""
    return jax.process_count() > 1


def is_leader() -> bool:
    """Whether this process is process 0: the one that writes files for the run."""
    return jax.process_index() == 0


def host_array(value: Any) -> np.ndarray:
    """``value`` as a NumPy array holding all of it, on every process.

    An array with shards on other processes is gathered (a collective: every process
    must call this for the same array); anything else is ``np.asarray(value)``.
    """
    spread = isinstance(value, jax.Array) and not value.is_fully_addressable
    if spread and not value.is_fully_replicated:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value)


def place(value: Any, sharding: jax.sharding.Sharding) -> Any:
    """``jax.device_put(value, sharding)``, also from other processes' shards.

    A value spread over several processes is gathered first (a collective) when the
    target lies on this process alone, as a one-device reference does.
    """
    spread = isinstance(value, jax.Array) and not value.is_fully_addressable
    if spread and sharding.is_fully_addressable:
        value = host_array(value)
    return jax.device_put(value, sharding)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier called ``name``."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)


def gather_text(text: str) -> list[str]:
    """Every process's ``text``, by process index (a collective)."""
    if not is_multiprocess():
        return [text]
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([data.size], np.int64))
    longest = int(lengths.max())
    padded = np.zeros(max(longest, 1), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths.ravel(), strict=True)]


def gather_ints(values: Sequence[int]) -> list[tuple[int, ...]]:
    """Every process's small integers ``values`` (int32), by process index (a collective)."""
    if not is_multiprocess():
        return [tuple(values)]
    rows = multihost_utils.process_allgather(np.asarray(values, np.int32))
    return [tuple(int(v) for v in row) for row in rows]


def checksum(text: str) -> int:
    """A checksum of ``text`` that fits in an int32."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def differences(names: Sequence[str]) -> str:
    """How the processes' lists of ``names`` differ ("" if every process has the same).

    Compares a checksum first and exchanges the lists only when they differ; the
    message names each process that differs from process 0 and its first difference.
    """
    listing = "\n".join(names)
    if len(set(gather_ints([checksum(listing)]))) == 1:
        return ""
    lists = [text.split("\n") if text else [] for text in gather_text(listing)]
    lines = []
    for index, other in enumerate(lists[1:], start=1):
        if other == lists[0]:
            continue
        leader, here = set(lists[0]), set(other)
        only_here = [n for n in other if n not in leader]
        only_leader = [n for n in lists[0] if n not in here]
        if only_here or only_leader:
            detail = "; ".join(
                f"{len(found)} only on process {who} (first: {found[0]})"
                for who, found in ((index, only_here), (0, only_leader))
                if found
            )
        else:
            at = next(i for i, (a, b) in enumerate(zip(lists[0], other, strict=True)) if a != b)
            detail = f"same tests in another order (position {at}: {other[at]} vs {lists[0][at]})"
        lines.append(f"process {index} has {len(other)}, process 0 has {len(lists[0])}: {detail}")
    return "\n".join(lines)
