"""Every module method call of a forward, seen while it is traced, on either backend.

Linen's calls through a method interceptor; NNX's by wrapping the methods of every module
class in the model for the duration of the trace. What is done around each call is the
caller's: localisation sends the call's values to the host, the precision profile opens
a name scope the traced program keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from flax import linen as nn
from flax import nnx
from flax.core import tracers

from conformance.core.trees import join_path

_PATH_ATTR = "_conformance_module_path"


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """One module method call, as it is traced."""

    path: str
    """The module's path in the model (``""``: the top module)."""
    method: str
    args: tuple[tuple[Any, ...], dict[str, Any]]
    """Its positional and keyword arguments."""
    lifted: bool = False
    """Traced inside a Linen lifted transform (``nn.scan``, ``nn.remat``, ...), where a
    host callback is refused."""


Around = Callable[[ModuleCall, Callable[..., Any]], Any]
"""``around(call, run)``: runs the call and returns its output.

``run()`` calls the method with the call's own arguments; ``run(args, kwargs)`` with
others in their place (the same values, passed through an identity the caller traces).
"""


def _traced_method(name: str, base: Any) -> bool:
    """Whether a method of a module class is seen: ``__call__`` and public methods."""
    return name == "__call__" or (not name.startswith("_") and not hasattr(base, name))


def _runner(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """The ``run`` of :data:`Around` for a call of ``fun`` with ``args`` and ``kwargs``."""

    def run(
        new_args: tuple[Any, ...] | None = None, new_kwargs: dict[str, Any] | None = None
    ) -> Any:
        return fun(
            *(args if new_args is None else new_args),
            **(kwargs if new_kwargs is None else new_kwargs),
        )

    return run


@contextlib.contextmanager
def linen_calls(around: Around) -> Iterator[None]:
    """Route every Linen module method call traced inside the block through ``around``.

    Enter it inside the traced function: a call is ``lifted`` when its module's trace is
    not the one the block was entered in.
    """
    outer = tracers.current_trace()

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if not _traced_method(context.method_name, nn.Module):
            return next_fun(*args, **kwargs)
        lifted = context.module.scope.trace_level != outer
        path = "/".join(context.module.path)
        call = ModuleCall(path, context.method_name, (args, kwargs), lifted)
        return around(call, _runner(next_fun, args, kwargs))

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def nnx_calls(model: nnx.Module, around: Around) -> Iterator[None]:
    """Route every method call of ``model``'s modules inside the block through ``around``.

    The methods of every module class in ``model`` are wrapped for the block's duration
    and restored after it; calls of modules outside ``model`` run unwrapped.
    """
    classes = set()
    for path, module in nnx.iter_modules(model):
        object.__setattr__(module, _PATH_ATTR, join_path(path))
        if not isinstance(module, nnx.List | nnx.Dict):
            classes.add(type(module))
    originals = {
        (cls, name): (name in vars(cls), inspect.getattr_static(cls, name))
        for cls in classes
        for name in dir(cls)
        if _traced_method(name, nnx.Module)
        and inspect.isfunction(inspect.getattr_static(cls, name))
    }

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
            path = getattr(self, _PATH_ATTR, None)
            if path is None:
                return method(self, *args, **kwargs)
            call = ModuleCall(path, name, (args, kwargs))
            return around(call, _runner(functools.partial(method, self), args, kwargs))

        return wrapped

    try:
        for (cls, name), (_, method) in originals.items():
            setattr(cls, name, wrap(name, method))
        yield
    finally:
        for (cls, name), (own, method) in originals.items():
            if own:
                setattr(cls, name, method)
            else:
                delattr(cls, name)
