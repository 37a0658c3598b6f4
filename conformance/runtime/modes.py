"""Modes of NNX: a family's NNX model in flax's tree mode, or on jax's explicit axes.

flax 0.12 traces NNX transforms in graph mode by default and plans tree mode as the
default (``nnx_graph_mode=False``, ``nnx_graph_updates=False``). :func:`tree_mode` runs
what it encloses in tree mode; :class:`NnxTreeSide` is the family's NNX model there: the
rewrite it declares for tree mode (:class:`~conformance.contract.TreeMode`), or its own
NNX module.

jax's explicit sharding mode makes each array's sharding part of its type.
:func:`explicit_sharding` runs what it encloses with a case's mesh made explicit;
:class:`NnxExplicitSide` is the family's NNX model there: the rewrite it declares for
explicit axes (:class:`~conformance.contract.ExplicitSharding`), or its own NNX module.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import jax
from flax import nnx

from conformance.contract import ExplicitSharding, Family, TreeMode, declared
from conformance.core.scope import Scope
from conformance.core.sharding import explicit
from conformance.core.trees import join_path
from conformance.runtime.case import Case
from conformance.runtime.sides import NnxSide


@contextlib.contextmanager
def tree_mode() -> Iterator[None]:
    """Everything built, traced and compiled inside runs in NNX tree mode.

    In a scope of its own: runners are memoised by family and config, not by mode, so
    the ones built here are kept apart from graph mode's, and released on leaving.
    """
    with Scope(keep_programs=True), nnx.set_graph_mode(False), nnx.set_graph_updates(False):
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


def rewrite(family: Family, mode: type[TreeMode | ExplicitSharding] = TreeMode) -> Family:
    """``family`` building the rewrite it declares for ``mode`` as its NNX module, if any."""
    found = declared(family, mode)
    if found is None or found.nnx_module is None:
        return family
    view = copy.copy(family)
    object.__setattr__(view, "nnx_module", found.nnx_module)
    return view


@dataclasses.dataclass(frozen=True)
class NnxTreeSide(NnxSide):
    """The NNX model in tree mode: built, traced and run only inside :func:`tree_mode`.

    Its case's family builds the rewrite the family declares for tree mode
    (:func:`rewrite`); its parameter paths are canonical, as graph mode's are.
    """

    name: ClassVar[str] = "NNX tree mode"

    @classmethod
    def of(cls, case: Case) -> NnxTreeSide:
        """The tree-mode side of ``case``."""
        return cls(dataclasses.replace(case, family=rewrite(case.family)))


@contextlib.contextmanager
def explicit_sharding(case: Case) -> Iterator[Case]:
    """``case`` on its devices with every mesh axis explicit, set as the mesh in context.

    Everything traced inside sees the explicit mesh (``jax.set_mesh``), in a scope of its
    own, as :func:`tree_mode`'s: a runner bound to the explicit mesh is kept apart.
    """
    if case.devices is None:
        raise ValueError(f"{case.family.name}: explicit sharding needs a case on devices")
    mesh = explicit(case.devices)
    with Scope(keep_programs=True), jax.set_mesh(mesh):
        yield dataclasses.replace(case, devices=mesh)


@dataclasses.dataclass(frozen=True)
class NnxExplicitSide(NnxSide):
    """The NNX model on explicit axes: built, traced and run inside :func:`explicit_sharding`.

    Its case is the one :func:`explicit_sharding` yields, whose family builds the rewrite
    it declares for explicit axes (:func:`rewrite`); its parameter paths are canonical.
    """

    name: ClassVar[str] = "NNX explicit sharding"

    @classmethod
    def of(cls, case: Case) -> NnxExplicitSide:
        """The explicit side of ``case`` (as :func:`explicit_sharding` yields it)."""
        family = rewrite(case.family, ExplicitSharding)
        return cls(dataclasses.replace(case, family=family))
