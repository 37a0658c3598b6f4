"""One executable per distinct program: each computation is compiled once per scope.

jax compiles a program again whenever another jit object traces it: a runner built for
an equal config, a float and a quantized model whose initialisers are the same
computation, the same train-state constructor of two trainers. Its persistent cache
would deduplicate them by content, but through files it reads back and deserializes.
:func:`install` deduplicates in memory instead: while a program's executable is live
it is handed to every later compile of the same program (jax's cache key: the
program's text, its devices' ids and compile options), until :func:`forget` drops it, as
:meth:`conformance.core.scope.Scope.release` does. Nothing is ever read back.

A release between groups of tests (another mesh, layout or family) need not drop the
programs that run on one device: no mesh shapes them, so later groups compile the very
same ones again (jax's one-operation programs, which ``jax.clear_caches`` forgets, and
the checks' one-device references), and each holds only a few memory mappings.
``forget(keep_one_device=True)`` keeps them.

jax has no public hook for this: :func:`install` wraps the function jax 0.12 compiles
every program through (``jax._src.compiler.compile_or_get_cached``), after checking its
signature, and says so in :func:`summary`. Programs with host callbacks, or that inspect
a sharding (the custom call of ``jax.debug.inspect_array_sharding``, which the partitioner
answers while it compiles), are compiled every time and where they are needed: their
callbacks are bound, or called, by that compile, and a program another process compiled
never calls this one's.

In a multi-controller run every process compiles the same programs. After
:func:`share_between_processes`, a program whose devices span processes is compiled by
one of them (the process of its first device, as jax's own
``jax_share_binary_between_hosts`` does) and handed to the others through the run's
key-value store, serialized; a process that cannot get it in time compiles it itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

_PARAMETERS = (
    "backend",
    "computation",
    "devices",
    "compile_options",
    "host_callbacks",
    "executable_devices",
    "pgle_profiler",
)
"""The signature of jax's compile entry point this module wraps (jax 0.12)."""


@dataclasses.dataclass
class Counts:
    """What the process compiled: programs compiled, distinct programs, compiles saved.

    ``received``: programs another process of a multi-controller run compiled for this one.
    """

    compiled: int = 0
    reused: int = 0
    received: int = 0
    distinct: set[str] = dataclasses.field(default_factory=set)

    def as_data(self) -> dict[str, Any]:
        """The counts as plain data, for another process to :meth:`add`."""
        return {
            "compiled": self.compiled,
            "reused": self.reused,
            "received": self.received,
            "distinct": sorted(self.distinct),
        }

    def add(self, data: Mapping[str, Any]) -> None:
        """Count another process's :meth:`as_data` in: a program both compiled is one distinct."""
        self.compiled += data["compiled"]
        self.reused += data["reused"]
        self.received += data.get("received", 0)
        self.distinct.update(data["distinct"])


COUNTS = Counts()
_LIVE: dict[str, tuple[Any, bool]] = {}
"""``{cache key: (executable, runs on one device)}``."""
_STATE = {"installed": False, "refused": ""}
_SHARING: dict[str, Any] = {}
"""``{"client": jax's distributed client, "timeout_ms": int}`` once sharing is on."""
_FAILED = b""
"""What the compiling process publishes for a program it could not compile."""
_INSPECTS = b"InspectSharding"
"""The custom call a sharding inspection lowers to, as it appears in a program's bytecode."""


def _canonical(computation: Any) -> bytes:
    """The program as jax's cache key reads it: its bytecode, debug locations stripped."""
    from jax._src import cache_key, config

    if config.compilation_cache_include_metadata_in_key.value:
        return cache_key._serialize_ir(computation, False)
    return cache_key._canonicalize_ir(computation, False)


def _key(backend: Any, canonical: bytes, devices: Any, options: Any) -> str:
    """A program's cache key as jax computes it, but the same in every process.

    jax's key hashes the devices' topology, whose fingerprint differs between the
    processes of a CPU run (jax 0.12); this one hashes the devices' global ids instead,
    so that a multi-controller run can name a program it shares between processes.
    ``canonical`` is the program's :func:`_canonical` bytes.
    """
    from jax._src import cache_key

    digest = hashlib.sha256(canonical)
    cache_key._hash_platform(digest, backend)
    cache_key._hash_xla_flags(digest, cache_key.get_flag_prefixes())
    cache_key._hash_serialized_compile_options(digest, options)
    digest.update(np.asarray([d.id for d in np.ravel(devices)], np.int64).tobytes())
    return digest.hexdigest()


def _one_device(devices: Any) -> bool:
    """Whether ``devices`` (jax passes an array of them, or ``None``) is a single device."""
    return devices is not None and np.size(devices) == 1


def _deduplicating(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_reuse(
        backend: Any,
        computation: Any,
        devices: Any,
        compile_options: Any,
        host_callbacks: Any,
        executable_devices: Any,
        pgle_profiler: Any = None,
    ) -> Any:
        args = (backend, computation, devices, compile_options, host_callbacks)
        canonical = _canonical(computation)
        key = _key(backend, canonical, devices, compile_options)
        COUNTS.distinct.add(key)
        if host_callbacks or _INSPECTS in canonical:
            COUNTS.compiled += 1
            return compile_fn(*args, executable_devices, pgle_profiler)
        if (live := _LIVE.get(key)) is not None:
            COUNTS.reused += 1
            return live[0]
        if _SHARING and (compiler := _compiling_process(devices)) is not None:
            executable = _shared(compile_fn, args, executable_devices, pgle_profiler, key, compiler)
        else:
            COUNTS.compiled += 1
            executable = compile_fn(*args, executable_devices, pgle_profiler)
        _LIVE[key] = (executable, _one_device(devices))
        return executable

    return compile_or_reuse


def _compiling_process(devices: Any) -> int | None:
    """The process that compiles a program on ``devices`` for all, if they span processes."""
    if devices is None:
        return None
    flat = list(np.ravel(devices))
    if len({d.process_index for d in flat}) < 2:
        return None
    return min(flat, key=lambda d: d.id).process_index


def _shared(
    compile_fn: Callable[..., Any],
    args: tuple[Any, ...],
    executable_devices: Any,
    pgle_profiler: Any,
    key: str,
    compiler: int,
) -> Any:
    """Compile and publish the program (on ``compiler``), or receive it from there."""
    import jax

    backend, _, _, compile_options, host_callbacks = args
    client = _SHARING["client"]
    name = f"conformance/programs/{key}"
    if jax.process_index() == compiler:
        COUNTS.compiled += 1
        try:
            executable = compile_fn(*args, executable_devices, pgle_profiler)
        except Exception:
            client.key_value_set_bytes(name, _FAILED, allow_overwrite=True)
            raise
        data = zlib.compress(backend.serialize_executable(executable), 1)
        client.key_value_set_bytes(name, data, allow_overwrite=True)
        return executable
    try:
        data = client.blocking_key_value_get_bytes(name, _SHARING["timeout_ms"])
    except jax.errors.JaxRuntimeError:  # not published in time
        data = _FAILED
    if data == _FAILED:
        COUNTS.compiled += 1
        return compile_fn(*args, executable_devices, pgle_profiler)
    COUNTS.received += 1
    return backend.deserialize_executable(
        zlib.decompress(data), executable_devices, compile_options, host_callbacks
    )


def share_between_processes(timeout_s: float) -> None:
    """In a multi-controller run, compile each program that spans processes only once.

    The process of a program's first device compiles it and publishes it in the run's
    key-value store; the others wait for it (at most ``timeout_s``, then compile it
    themselves, as they do when its compile failed there). Call after
    ``jax.distributed.initialize`` and :func:`install`; with one process it does nothing.
    """
    from jax._src import distributed

    if distributed.global_state.client is not None:
        _SHARING.update(client=distributed.global_state.client, timeout_ms=int(timeout_s * 1000))


def install() -> bool:
    """Share live executables between compiles of one program; ``True`` once installed.

    Refuses (returns ``False``, :func:`summary` says why) if jax's compile entry point
    does not have the signature this module was written for.
    """
    if _STATE["installed"]:
        return True
    from jax._src import compiler

    found = tuple(inspect.signature(compiler.compile_or_get_cached).parameters)
    if found != _PARAMETERS:
        _STATE["refused"] = f"jax's compile_or_get_cached{found} is not the one expected"
        return False
    compiler.compile_or_get_cached = _deduplicating(compiler.compile_or_get_cached)
    _STATE["installed"] = True
    return True


def forget(*, keep_one_device: bool = False) -> None:
    """Drop the live executables this module holds; the next compile of each compiles.

    With ``keep_one_device``, programs that run on a single device stay live.
    """
    for key in [k for k, (_, one) in _LIVE.items() if not (keep_one_device and one)]:
        del _LIVE[key]


def summary() -> str:
    """``N programs compiled, M distinct`` (and the compiles saved), or why none were counted."""
    if not _STATE["installed"]:
        return f"compiles not deduplicated: {_STATE['refused'] or 'not installed'}"
    distinct = len(COUNTS.distinct)
    received = f"; {COUNTS.received} received from another process" if COUNTS.received else ""
    return (
        f"{COUNTS.compiled} programs compiled, {distinct} distinct "
        f"({COUNTS.reused} compiles of an identical live program saved{received})"
    )
