r"""Modes of NNX: a family's NNX model in flax's tree mode, or on jax's explicit axes.

flax 0.12 traces NNX transforms in graph mode by default and plans tree mode as the
default (``nnx_graph_mode=False``, ``nnx_graph_updates=False``). :func:`tree_mode` runs
what it encloses in tree mode; :class:`NnxTreeSide` is the family's NNX model there: the
rewrite it declares for tree mode (:class:`~conformance.contract.TreeMode`), or its own
NNX module.

jax's explicit sharding mode makes each array's sharding part of its type.
:class:`NnxExplicitSide` is the family's NNX model on its case's devices with every
mesh axis explicit: the rewrite it declares for explicit axes
(:class:`~conformance.contract.ExplicitSharding`), or its own NNX module.

Both are mode sides (:class:`ModeSide`): whatever check calls them, they build, trace and run in
their mode. :class:`NnxGraphSide` and :class:`NnxAutoSide` are the NNX model in the
default modes, named as such.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import functools
import traceback
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
from flax import nnx
from jax.sharding import Mesh

from conformance.contract import ExplicitSharding, Family, TreeMode, declared
from conformance.core.scope import apart
from conformance.core.sharding import explicit, moved_to
from conformance.core.trees import Flat, join_path
from conformance.runtime.aqt import NnxAqt
from conformance.runtime.backends import NnxRunner
from conformance.runtime.case import Case
from conformance.runtime.decoding import Decoder
from conformance.runtime.live import NnxSide
from conformance.runtime.training import NnxTrainer

_TREE, _EXPLICIT = "nnx-tree-mode", "explicit-axes"
"""The tags runners built in each mode are memoised apart under (:func:`apart`)."""


@contextlib.contextmanager
def tree_mode() -> Iterator[None]:
    """Everything built, traced and compiled inside runs in NNX tree mode.

    Runners are memoised by family and config, not by mode: the ones built here are
    kept apart from graph mode's, and shared by every check of the scope.
    """
    with apart(_TREE), nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        yield


@dataclasses.dataclass(frozen=True)
class Shared:
    """One object a model holds at more than one path: what tree mode cannot build."""

    paths: tuple[str, ...]
    kind: str
    """The shared object's class name (``Rngs``, ``Embed``, ``Param``)."""

    def describe(self) -> str:
        """``<kind> at <path> and <path>``, with the rewrite tree mode needs."""
        where = f"{self.kind} at {' and '.join(self.paths)}"
        if self.kind == "Rngs":
            return (
                f"{where} (a module keeps the nnx.Rngs it hands to a sub-module, which keeps "
                "it too: keep it in one of them, or give the sub-module streams of its own)"
            )
        return f"{where} (call one module where the other was, as a head tied to the " + (
            "embedding calls embed.attend(x))"
        )


def shared_references(model: nnx.Module) -> list[Shared]:
    """Each object ``model`` holds at more than one path, which tree mode cannot hold.

    Building the model in tree mode raises ``ValueError: Duplicate ...`` for each.
    """
    nodes = dict(nnx.iter_graph(model))
    return [
        Shared(
            tuple(join_path(path) for path in paths),
            type(nodes.get(tuple(paths[0]), model)).__name__,
        )
        for paths in nnx.find_duplicates(model)
    ]


@functools.cache
def rewrite(family: Family, mode: type[TreeMode | ExplicitSharding] = TreeMode) -> Family:
    """``family`` building the rewrite it declares for ``mode`` as its NNX module, if any.

    One view per family and mode, so runners built from it are shared as the family's are.
    """
    found = declared(family, mode)
    if found is None or found.nnx_module is None:
        return family
    view = copy.copy(family)
    object.__setattr__(view, "nnx_module", found.nnx_module)
    return view


def accepted(family: Family) -> dict[str, str]:
    """``TreeMode(accept=...)`` of ``family``: ``{rewrite-only parameter: its source}``.

    Each source is the graph-mode parameter it starts as. Raises :class:`ValueError`
    unless the entries are ``(path, source)`` pairs of strings, each path once.
    """
    found = declared(family, TreeMode)
    entries = () if found is None else found.accept
    if not all(
        isinstance(e, tuple) and len(e) == 2 and all(isinstance(p, str) for p in e) for e in entries
    ):
        raise ValueError(
            f"TreeMode(accept=...) takes (path, source) pairs of strings, not {entries!r}"
        )
    if repeated := sorted({path for path, _ in entries if sum(p == path for p, _ in entries) > 1}):
        raise ValueError(f"TreeMode(accept=...) names {', '.join(repeated)} more than once")
    return dict(entries)


class InMode:
    """``target`` with its attributes read and its methods run in ``side``'s mode.

    What it returns that can be called in turn (a jitted step, a bound method) runs
    there too, and arguments are first taken onto the side's devices
    (:meth:`ModeSide.adopt`). ``isinstance`` sees the target's class, and it is equal
    to (and hashes as) the target.
    """

    __slots__ = ("__weakref__", "_side", "_target")

    def __init__(self, target: Any, side: ModeSide) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_side", side)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._target)

    def __getattr__(self, name: str) -> Any:
        with self._side.entered():
            return _in_mode(getattr(self._target, name), self._side)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The target called in the mode; inside a trace, its arguments left as they are."""
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        if not traced:
            args, kwargs = self._side.adopt((args, kwargs))
        with self._side.entered(traced=traced):
            return _in_mode(self._target(*args, **kwargs), self._side)

    def __eq__(self, other: object) -> bool:
        return self._target == (other._target if isinstance(other, InMode) else other)

    def __hash__(self) -> int:
        return hash(self._target)


def _in_mode(value: Any, side: ModeSide) -> Any:
    """``value`` in ``side``'s mode: a runtime object of the side, or a callable.

    A class or a module is returned as it is, as is anything else not callable.
    """
    if type(value) is InMode or isinstance(value, type | nnx.Module):
        return value
    return InMode(value, side) if callable(value) or isinstance(value, tuple(side.parts)) else value


@dataclasses.dataclass(frozen=True)
class ModeSide(NnxSide):
    """The NNX model in a mode its runners do not name: built, traced and run in it.

    Its runner, trainers, decoders and AQT model run every method in the mode
    (:class:`InMode`), so a check uses it as any other side, and the mode's programs
    are built once per scope (:func:`~conformance.core.scope.apart`).
    """

    @abc.abstractmethod
    def entered(self, *, traced: bool = False) -> contextlib.AbstractContextManager[None]:
        """The mode: everything built, traced and run inside is in it.

        ``traced``: entered inside a trace that was started outside it (a program the
        harness traces around one of the side's functions).
        """

    def adopt(self, value: Any) -> Any:
        """``value`` (any pytree of arguments) as this side's programs take it."""
        return value

    @property
    def runner(self) -> NnxRunner:
        """The NNX runner, built and run in the mode."""
        with self.entered():
            return InMode(super().runner, self)

    def trainer(self, micro_batches: int = 1, vocab_tiles: int = 1) -> NnxTrainer:
        """The NNX trainer, built and run in the mode."""
        with self.entered():
            return InMode(super().trainer(micro_batches, vocab_tiles), self)

    def decoder(self, rows: int) -> Decoder:
        """The NNX model served through its cache, built and run in the mode."""
        with self.entered():
            return InMode(super().decoder(rows), self)

    def aqt(self) -> NnxAqt:
        """The NNX model in AQT modes, built and run in the mode."""
        with self.entered():
            return InMode(super().aqt(), self)


def mode_of(error: BaseException) -> ModeSide | None:
    """The mode side ``error`` was raised in, building or running its objects, if any."""
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, InMode):
            found = owner._side
        elif isinstance(owner, ModeSide):
            found = owner
    return found


@dataclasses.dataclass(frozen=True)
class NnxGraphSide(NnxSide):
    """The NNX model in graph mode, flax's default: what tree mode is compared with."""

    name: ClassVar[str] = "NNX graph mode"
    key: ClassVar[str] = "nnx-graph"


@dataclasses.dataclass(frozen=True)
class NnxTreeSide(ModeSide):
    """The NNX model in tree mode (:func:`tree_mode`).

    Its case's family builds the rewrite the family declares for tree mode
    (:func:`rewrite`); its parameter paths are canonical, as graph mode's are. A
    parameter the rewrite holds on purpose where graph mode holds none
    (``TreeMode(accept=((path, source), ...))``) starts as a copy of ``source``, and is
    left out of what the side gives to be compared, with its gradient and optimizer
    state (every leaf whose path is ``path`` or ends in ``/path``).
    """

    name: ClassVar[str] = "NNX tree mode"
    key: ClassVar[str] = "nnx-tree"

    def canonical(self, flat: Flat) -> Flat:
        """``flat`` without the accepted parameters' leaves (:func:`accepted`)."""
        own = accepted(self.case.family)
        return {p: v for p, v in flat.items() if not any(_ends_in(p, a) for a in own)}

    def own(self, flat: Flat) -> Flat:
        """``flat`` with each accepted parameter's leaves copied from its source's."""
        found = dict(flat)
        for path, source in accepted(self.case.family).items():
            for key, value in flat.items():
                if _ends_in(key, source):
                    found[key.removesuffix(source) + path] = value
        return found

    @classmethod
    def of(cls, case: Case) -> NnxTreeSide:
        """The tree-mode side of ``case``."""
        return cls(dataclasses.replace(case, family=rewrite(case.family)))

    def entered(self, *, traced: bool = False) -> contextlib.AbstractContextManager[None]:
        """:func:`tree_mode`."""
        return tree_mode()


def _ends_in(path: str, tail: str) -> bool:
    return path == tail or path.endswith("/" + tail)


def _explicit_case(case: Case) -> Case:
    if case.devices is None:
        raise ValueError(f"{case.family.name}: explicit sharding needs a case on devices")
    return dataclasses.replace(case, devices=explicit(case.devices))


@contextlib.contextmanager
def _on(mesh: Mesh, *, traced: bool = False) -> Iterator[None]:
    """``mesh`` in context: set outside a trace, its abstract mesh inside one.

    jax refuses ``set_mesh`` inside a trace.
    """
    context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if traced else jax.set_mesh(mesh)
    with apart(_EXPLICIT), context:
        yield


@dataclasses.dataclass(frozen=True)
class NnxAutoSide(NnxSide):
    """The NNX model on auto mesh axes, jax's default: what explicit axes are compared with."""

    name: ClassVar[str] = "NNX auto sharding"
    key: ClassVar[str] = "nnx-auto"


@dataclasses.dataclass(frozen=True)
class NnxExplicitSide(ModeSide):
    """The NNX model on its case's devices with every axis explicit, the mesh in context.

    Its case's family builds the rewrite it declares for explicit axes (:func:`rewrite`);
    its parameter paths are canonical. Arrays given to its programs are taken onto the
    explicit mesh, laid out as they were.
    """

    name: ClassVar[str] = "NNX explicit sharding"
    key: ClassVar[str] = "nnx-explicit"
    lays_out_itself: ClassVar[bool] = True

    @classmethod
    def of(cls, case: Case) -> NnxExplicitSide:
        """The explicit side of ``case`` (the same case on the explicit mesh)."""
        family = rewrite(case.family, ExplicitSharding)
        return cls(_explicit_case(dataclasses.replace(case, family=family)))

    def on(self, case: Case) -> NnxExplicitSide:
        """The explicit side of ``case``, its family's rewrite kept."""
        return type(self)(_explicit_case(dataclasses.replace(case, family=self.case.family)))

    def entered(self, *, traced: bool = False) -> contextlib.AbstractContextManager[None]:
        """Its mesh set in context (``jax.set_mesh``; its abstract mesh inside a trace)."""
        return _on(self.case.devices, traced=traced)

    def adopt(self, value: Any) -> Any:
        """``value`` with each array laid out on another mesh moved to this side's."""
        return moved_to(value, self.case.devices)
