"""How long compiled programs live: a scope that owns the harness's runners and frees them.

Every runner, trainer and decoder holds jitted functions, and every jitted function
holds its compiled executables. On the CPU backend each executable keeps its machine
code mapped into the process; a long run that never lets go of them grows its memory
mappings by hundreds per test until the kernel's ``vm.max_map_count`` (65,530 by
default) is reached and XLA crashes while compiling.

So the factories that build those objects (:func:`conformance.runtime.backends.linen_runner`
and the like) are :func:`scoped`: they memoise in the innermost active :class:`Scope`,
and leaving the scope drops everything built in it and clears jax's own caches, so the
next programs reuse the freed memory. Within a scope, checks that run the same
computation share one compiled program.

Factories marked :func:`kept` return results on the host (numpy arrays, no compiled
programs), for example a check's one-device reference. They are memoised apart, and
``release(keep_results=True)`` frees the programs while keeping them, so a reference
is computed once even when the programs that made it are released.

The pytest plugin opens one scope per group of tests that can share programs (same
family, layer layout and mesh). Library users open their own::

    with Scope():
        check_forward(family, config, mesh, devices)
    # every executable compiled inside is released here

Outside any ``with Scope()``, factories memoise in a process-wide default scope, which
:func:`release` empties.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import inspect
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import jax

from conformance.core import programs


class Scope:
    """A memo of scoped factories' results; leaving it (or :meth:`release`) frees them all.

    ``keep_programs``: leaving it keeps every compiled program live for the scopes that
    follow, within the mapping budget (see :meth:`release`): for a run of scopes that
    rebuild the same models, as the harness's planted faults do.
    """

    def __init__(self, *, keep_programs: bool = False) -> None:
        self._memo: dict[Hashable, Any] = {}
        self._results: dict[Hashable, Any] = {}
        self._tokens: list[contextvars.Token[Scope]] = []
        self._keep_programs = keep_programs

    def __len__(self) -> int:
        return len(self._memo)

    def get[R](
        self,
        factory: Callable[..., R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        result: bool = False,
    ) -> R:
        """``factory(*args, **kwargs)``, built once in this scope for equal arguments.

        With ``result``, the value holds no compiled program and survives
        ``release(keep_results=True)``.
        """
        key = (factory, args, tuple(sorted(kwargs.items())), _APART.get())
        try:
            hash(key)
        except TypeError as err:
            raise TypeError(
                f"{factory.__name__} is built once per argument set, so its arguments must be "
                f"hashable ({err}): a Family and its configs must be hashable, e.g. a frozen "
                "dataclass"
            ) from None
        memo = self._results if result else self._memo
        if key not in memo:
            memo[key] = factory(*args, **kwargs)
        return memo[key]

    def release(self, *, keep_results: bool = False, keep_programs: bool = False) -> None:
        """Drop everything built in this scope and every executable held for reuse.

        That is jax's caches and :mod:`~conformance.core.programs`' live executables,
        but for those that run on one device while the process holds fewer memory
        mappings than :func:`mapping_budget`: no mesh shapes them, so later scopes run
        the same ones. jax's caches are process-wide, so programs compiled outside this
        scope are recompiled on their next call; nothing is lost but time. With
        ``keep_results``, the values of :func:`kept` factories stay; with
        ``keep_programs``, every live executable stays while under the budget.
        """
        self._memo.clear()
        if not keep_results:
            self._results.clear()
        budget, mappings = mapping_budget(), mapping_count()
        within = budget is None or (mappings or 0) < budget
        if not (keep_programs and within):
            programs.forget(keep_one_device=within)
        jax.clear_caches()
        gc.collect()

    def __enter__(self) -> Scope:
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _ACTIVE.reset(self._tokens.pop())
        self.release(keep_programs=self._keep_programs)


_DEFAULT = Scope()
_ACTIVE: contextvars.ContextVar[Scope] = contextvars.ContextVar(
    "conformance_scope", default=_DEFAULT
)


_APART: contextvars.ContextVar[tuple[Hashable, ...]] = contextvars.ContextVar(
    "conformance_apart", default=()
)


@contextlib.contextmanager
def apart(tag: Hashable) -> Iterator[None]:
    """Factories called inside memoise apart from the same calls outside, under ``tag``.

    For one model built in a mode its arguments do not name (flax's tree mode, jax's
    explicit axes): each mode's runners are built once per scope and shared by every
    check in it, never handed to the other mode.
    """
    token = _APART.set((*_APART.get(), tag))
    try:
        yield
    finally:
        _APART.reset(token)


def current() -> Scope:
    """The innermost active scope (the process-wide default one outside any)."""
    return _ACTIVE.get()


def release(*, keep_results: bool = False) -> None:
    """Release the innermost active scope: see :meth:`Scope.release`."""
    current().release(keep_results=keep_results)


def mapping_count() -> int | None:
    """How many memory mappings this process has (Linux), or ``None`` where unknown."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def mapping_limit() -> int | None:
    """The kernel's per-process limit on memory mappings (Linux), or ``None``."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def mapping_budget() -> int | None:
    """Half the kernel's limit on memory mappings (Linux), or ``None`` where unknown.

    Past it, releases drop every compiled program, however small.
    """
    limit = mapping_limit()
    return None if limit is None else limit // 2


def _memoised[**P, R](factory: Callable[P, R], result: bool) -> Callable[P, R]:
    """``factory`` memoised in the active scope, keyed by its bound arguments.

    Defaults are applied: ``f(a)`` and ``f(a, 1)`` share one value when 1 is the default.
    """
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def memoised(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return current().get(factory, bound.args, bound.kwargs, result=result)

    return memoised


def scoped[**P, R](factory: Callable[P, R]) -> Callable[P, R]:
    """Memoise ``factory`` (hashable arguments) in the active :class:`Scope`."""
    return _memoised(factory, result=False)


def kept[**P, R](factory: Callable[P, R]) -> Callable[P, R]:
    """Memoise ``factory``, whose results hold no compiled program, in the active scope.

    Unlike :func:`scoped` values, they outlive ``release(keep_results=True)``.
    """
    return _memoised(factory, result=True)
