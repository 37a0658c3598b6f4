"""Emulate a multi-host run on one machine: N local processes, each with its own CPU devices.

Each process runs ``python -m conformance`` with the same arguments, joined to the
others through ``jax.distributed`` on a free localhost port, as the hosts of a pod
slice are. Process 0's output is shown as it runs; every process's output is kept in
``<logs>/process-<i>.log``. If a process fails, the others are stopped; if the run
outlives its timeout, all are stopped; the exit status is the first failure's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

DEVICE_FLAG = "--xla_force_host_platform_device_count"
TIMED_OUT = 124
"""The exit status of a run stopped by its timeout (as ``timeout(1)`` uses)."""
GRACE_S = 30.0
"""How long the other processes may still run once one has failed."""


@dataclasses.dataclass(frozen=True)
class Emulation:
    """The shape of an emulated multi-host run."""

    processes: int
    devices_per_process: int
    timeout_s: float
    logs: Path
    connect_timeout_s: int = 60


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def process_env(devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) for one emulated host's process.

    It gets ``devices`` CPU devices, whatever device count ``XLA_FLAGS`` already asked
    for, runs on the CPU, and writes its output unbuffered.
    """
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def commands(emulation: Emulation, args: Sequence[str], port: int) -> list[list[str]]:
    """Each process's command line: ``args`` plus how to join the run."""
    shared = emulation.logs / "shared"
    return [
        [
            sys.executable,
            "-m",
            "conformance",
            *args,
            f"--coordinator=localhost:{port}",
            f"--num-processes={emulation.processes}",
            f"--process-id={index}",
            f"--connect-timeout={emulation.connect_timeout_s}",
            f"--shared-dir={shared}",
        ]
        for index in range(emulation.processes)
    ]


def _tee(stream: IO[bytes], log: IO[bytes], out: IO[bytes]) -> None:
    """Copy ``stream`` to ``log``, and to ``out`` without gloo's connection chatter."""
    for line in iter(stream.readline, b""):
        log.write(line)
        if not line.startswith(b"[Gloo] "):
            out.write(line)
            out.flush()


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop every running process: SIGTERM, then SIGKILL after a grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def describe_exit(code: int) -> str:
    """``exit 1`` or ``killed by SIGABRT``."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def run(emulation: Emulation, args: Sequence[str], out: IO[str] = sys.stdout) -> int:
    """Run ``python -m conformance args`` as an emulated multi-host run; its exit status.

    0 only if every process exits 0. Once one fails, the others get :data:`GRACE_S` to
    finish before they are stopped; :data:`TIMED_OUT` if the run outlives ``timeout_s``.
    SIGTERM stops every process before this one exits (status 143). A summary names each
    process's exit and log, with the end of each failed process's log.
    """
    emulation.logs.mkdir(parents=True, exist_ok=True)
    (emulation.logs / "shared").mkdir(exist_ok=True)
    port = free_port()
    env = process_env(emulation.devices_per_process)
    logs = [emulation.logs / f"process-{i}.log" for i in range(emulation.processes)]
    print(
        f"conformance: emulating {emulation.processes} hosts x {emulation.devices_per_process} "
        f"CPU devices on localhost:{port}; logs in {emulation.logs}/",
        file=out,
        flush=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    files = [open(path, "wb") for path in logs]  # noqa: SIM115 (closed below)
    threads = []
    with _sigterm_as_exit():
        try:
            for index, command in enumerate(commands(emulation, args, port)):
                pipe = subprocess.PIPE if index == 0 else files[index]
                procs.append(
                    subprocess.Popen(command, env=env, stdout=pipe, stderr=subprocess.STDOUT)
                )
            if procs[0].stdout is not None:
                shown = getattr(out, "buffer", None) or sys.stdout.buffer
                thread = threading.Thread(target=_tee, args=(procs[0].stdout, files[0], shown))
                thread.start()
                threads.append(thread)
            status, why = watch(procs, emulation.timeout_s)
        finally:
            stop(procs)
            for thread in threads:
                thread.join()
            for file in files:
                file.close()
    out.flush()
    print(f"conformance: {why}", file=out)
    for index, (proc, path) in enumerate(zip(procs, logs, strict=True)):
        code = proc.returncode
        print(f"  process {index}: {describe_exit(code)}; log {path}", file=out)
        if code != 0 and index != 0:
            print(_tail(path), file=out)
    out.flush()
    return status


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM ends this process as ``SystemExit`` (status 143).

    Python's default for SIGTERM ends the process at once, skipping ``finally``: a CI
    runner cancelling the job, or ``timeout(1)``, would leave the emulated processes
    running. Off the main thread, where no handler can be set, it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def watch(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> tuple[int, str]:
    """Wait for every process; stop early on a failure or the timeout. ``(status, why)``.

    After the first failure the others get :data:`GRACE_S` to finish on their own (in
    step, they reach the same verdict at the same time), then are stopped.
    """
    deadline = time.monotonic() + timeout_s
    first: tuple[int, int] | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        if first is None:
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]
                deadline = min(deadline, time.monotonic() + GRACE_S)
        running = [i for i, c in enumerate(codes) if c is None]
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    stopped = f"; stopped process(es) {', '.join(map(str, running))}" if running else ""
    if first is not None:
        index, code = first
        return (code if code > 0 else 1), f"process {index} failed ({describe_exit(code)}){stopped}"
    if running:
        return TIMED_OUT, f"the run outlived its {timeout_s:g} s timeout{stopped}"
    return 0, f"all {len(procs)} processes passed"


def default_logs() -> Path:
    """A new directory for an emulated run's logs and shared files."""
    return Path(tempfile.mkdtemp(prefix="conformance-processes-"))
