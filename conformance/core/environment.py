"""Process set-up that must happen before jax starts a backend.

jax reads ``XLA_FLAGS`` when it creates its first backend, and its compilation-cache
settings before the first compile, so this runs from the root ``conftest.py`` and again,
harmlessly, from the pytest plugin's ``pytest_configure``.
"""

from __future__ import annotations

import importlib.metadata
import os

HOST_DEVICE_COUNT = 8
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "qwix", "aqtp", "maxtext")
"""The libraries whose versions a run's numbers depend on (reports and references name them)."""
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

XLA_OPT_LEVELS = ("low", "full")
"""``low``: XLA skips most optimisation passes (``jax_disable_most_optimizations``);
``full``: XLA's defaults, as production code compiles."""


def configure_host_platform(device_count: int = HOST_DEVICE_COUNT) -> None:
    """Ask XLA for ``device_count`` CPU devices; cache every program if a cache is chosen.

    A user's own choice always wins: if ``JAX_PLATFORMS`` names something other than the
    CPU, or ``XLA_FLAGS`` already sets a host device count, the device count is left
    alone. The persistent compilation cache stays off unless ``JAX_COMPILATION_CACHE_DIR``
    names one: with jaxlib 0.12.0.1, a process that runs executables read back from it
    aborts now and then (SIGABRT on a host transfer). When it is on, every program is
    cached, however fast it compiled.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    flags = os.environ.get("XLA_FLAGS", "")
    if platforms in ("", "cpu") and _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={device_count}".strip()

    import jax  # importing jax starts no backend: XLA_FLAGS above still takes effect

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def set_xla_opt(level: str) -> None:
    """Compile every program at XLA optimisation ``level`` (one of :data:`XLA_OPT_LEVELS`).

    ``low`` compiles several times faster, and compilation is nearly all of a
    conformance run's time; both backends compile under the same flags, so a Linen/NNX
    comparison stays like for like. ``full`` is what production code runs: use it for a
    nightly job. Must be called before the first compile.
    """
    if level not in XLA_OPT_LEVELS:
        raise ValueError(f"unknown XLA optimisation level {level!r}; use one of {XLA_OPT_LEVELS}")
    import jax

    jax.config.update("jax_disable_most_optimizations", level == "low")


def set_matmul_precision() -> str:
    """Multiply float32 matrices at float32 precision on every platform; return the setting.

    GPUs (TF32) and TPUs (bfloat16 passes) multiply float32 matrices at lower precision by
    default, so two correct backends that order or fuse their products differently would
    disagree by more than float32's tolerances (on an H200, ``grad_accumulation``,
    ``layout`` and ``vocab_tiling`` failed at jax's default and passed at ``highest``).
    The CPU always multiplies at full precision, so nothing changes there. A precision
    the user chose (``JAX_DEFAULT_MATMUL_PRECISION``) wins; one an operation asks for
    explicitly is kept.
    """
    import jax

    if not os.environ.get("JAX_DEFAULT_MATMUL_PRECISION"):
        jax.config.update("jax_default_matmul_precision", "highest")
    return str(jax.config.jax_default_matmul_precision)


GPU_DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
"""The ``XLA_FLAGS`` entry that makes XLA's GPU programs run-to-run deterministic."""


def nondeterminism() -> str | None:
    """Why one program run twice may give two answers on this backend, or ``None``.

    XLA's GPU programs reduce with atomics unless :data:`GPU_DETERMINISTIC_FLAG` is in
    ``XLA_FLAGS``: on an H200 a resumed train step differed from the same step run
    straight by up to 4e-5, and on an H100 with the flag it matched bit for bit. The
    CPU backend is deterministic.
    """
    import jax

    if jax.default_backend() != "gpu" or GPU_DETERMINISTIC_FLAG in os.environ.get("XLA_FLAGS", ""):
        return None
    return (
        "this GPU run is not run-to-run deterministic: XLA's reductions use atomics, so a "
        f"program run twice can round apart; rerun with XLA_FLAGS={GPU_DETERMINISTIC_FLAG} "
        "to tell that from a real difference"
    )


def nnx_mode() -> str:
    """The NNX transform defaults programs are traced under, in words.

    flax's ``nnx_graph_mode`` and ``nnx_graph_updates`` (read from the environment as
    ``NNX_GRAPH_MODE`` and ``NNX_GRAPH_UPDATES``): graph mode, flax 0.12's default, or tree
    mode, the default flax plans (FLIP 5310).
    """
    from flax import config

    graph, updates = config.nnx_graph_mode, config.nnx_graph_updates
    mode = "graph mode" if graph else "tree mode"
    return f"NNX {mode} (nnx_graph_mode={graph}, nnx_graph_updates={updates})"


def library_versions() -> dict[str, str]:
    """The installed version of each of :data:`LIBRARIES` (those not installed are left out)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
