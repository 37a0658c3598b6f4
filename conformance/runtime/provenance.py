"""Which code a side runs: the model class it built and the modules it bridged.

A migration ends with one backend wrapping the other: ``ToLinen`` runs an NNX module
inside a Linen model, ``ToNNX`` a Linen module inside an NNX model. Equal numbers then
prove nothing about the two backends, so each side counts the bridge modules it holds
(any module whose class, or a base class, is named as in :data:`BRIDGES`: Flax's and a
zoo's own, such as MaxText's ``nnx_wrappers.ToLinen``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from flax import linen as nn
from flax import nnx

BRIDGES = ("ToLinen", "ToNNX")
"""The bridge class names counted (``ToLinen``: NNX code in a Linen model; ``ToNNX``:
Linen code in an NNX model)."""


def bridge_of(module: object) -> str | None:
    """The bridge ``module`` is (a name in :data:`BRIDGES`), or ``None``."""
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in BRIDGES), None)


@dataclasses.dataclass(frozen=True)
class Built:
    """The model class a side built and how many modules of each bridge it holds."""

    model: str
    """The top module's class, ``module.QualName``."""
    bridged: dict[str, int]
    """``{bridge name: modules}`` for the bridges it holds (none: empty)."""
    whole: str | None = None
    """The bridge the top module itself is (``"ToLinen"``): the whole side is the other
    backend's model behind it, as maxtext 0.2.5's Linen ``TransformerLinen`` is."""

    def describe(self) -> str:
        """``pkg.mod.Class (3 ToLinen)``, or ``... (nothing bridged)``.

        A side that is a bridge as a whole adds ``; bridged: the other backend's model``.
        """
        found = ", ".join(f"{n} {kind}" for kind, n in sorted(self.bridged.items()))
        whole = "; bridged: the other backend's model" if self.whole else ""
        return f"{self.model} ({found or 'nothing bridged'}{whole})"


def _name(module: object) -> str:
    kind = type(module)
    return f"{kind.__module__}.{kind.__qualname__}"


def nnx_built(model: nnx.Module) -> Built:
    """What an NNX model (concrete or abstract) is built of."""
    kinds = (bridge_of(node) for _, node in nnx.iter_graph(model))
    found = dict(Counter(kind for kind in kinds if kind is not None))
    return Built(_name(model), found, bridge_of(model))


class LinenBridges:
    """Counts the bridge modules a Linen module runs, while :meth:`watching` is open."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, ...], str] = {}

    def watching(self) -> Any:
        """A context in which every bridge module called is counted once, by its path."""

        def count(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
            # Only calls: lifted transforms (remat, scan) wrap a bridge in helper modules
            # whose other methods run under the same class name.
            if context.method_name == "__call__" and (kind := bridge_of(context.module)):
                self._seen[tuple(context.module.path)] = kind
            return next_fun(*args, **kwargs)

        return nn.intercept_methods(count)

    def built(self, module: nn.Module) -> Built:
        """What ``module`` is built of, from what the watched calls ran."""
        return Built(_name(module), dict(Counter(self._seen.values())), bridge_of(module))
