"""Walking a traced program: the jaxprs inside an equation, and each equation's name stack."""

from __future__ import annotations

from collections.abc import Iterator

from jax.extend import core as jcore


def inner_jaxprs(eqn: jcore.JaxprEqn) -> Iterator[jcore.Jaxpr]:
    """The jaxprs ``eqn``'s parameters hold: ``jit``, ``remat`` and ``scan`` bodies, branches."""
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = item.jaxpr if isinstance(item, jcore.ClosedJaxpr) else item
            if isinstance(inner, jcore.Jaxpr):
                yield inner


def scoped_equations(jaxpr: jcore.Jaxpr, stack: str = "") -> Iterator[tuple[str, jcore.JaxprEqn]]:
    """Every equation of ``jaxpr`` and of the jaxprs inside it, with its full name stack.

    An inner jaxpr's name stacks are relative to the equation that holds it.
    """
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        yield here, eqn
        for inner in inner_jaxprs(eqn):
            yield from scoped_equations(inner, here)
